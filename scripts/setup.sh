#!/usr/bin/env bash
# One set-up step for a fresh machine, CI and developers alike. Idempotent: a second run
# only checks what is there and returns in seconds.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

# --- Debian packages: the real MQTT broker and the speech synthesisers for the corpus.
# festival and its voices are speech engines of the pretraining corpus (tools/CORPUS.md).
apt_pkgs=(mosquitto mosquitto-clients espeak-ng flite festival festvox-kallpc16k festvox-kdlpc16k
          festvox-us-slt-hts libsndfile1 openssl)
missing=()
for p in "${apt_pkgs[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
    echo "[setup] installing Debian packages: ${missing[*]}"
    sudo_cmd=""
    [ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
    $sudo_cmd apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    # wakefl starts its broker itself on demand. The service Debian starts with a mosquitto
    # it has just installed is stopped; a mosquitto that was there before is left alone.
    if [[ " ${missing[*]} " == *" mosquitto "* ]]; then
        $sudo_cmd systemctl disable --now mosquitto >/dev/null 2>&1 || true
    fi
fi

# --- Python virtual environment with the pinned dependencies.
py="${WAKEFL_PYTHON:-python3.11}"
command -v "$py" >/dev/null || py=python3
if [ ! -x .venv/bin/python ]; then
    echo "[setup] creating .venv"
    "$py" -m venv .venv
fi
stamp=.venv/.wakefl-installed
want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    echo "[setup] installing wakefl and its pinned dependencies into .venv (first time: several minutes)"
    # Machine-wide pip settings may name local index folders that do not exist; their
    # warnings are noise here.
    quiet_pip() { .venv/bin/python -m pip "$@" 2> >(grep -v "is ignored: it is neither" >&2); }
    quiet_pip install -q --upgrade "pip==26.3" "setuptools==80.9.0" wheel
    quiet_pip install -q -e ".[full,dev]"
    echo "$want" >"$stamp"
fi
echo "[setup] ready: $(.venv/bin/python -c 'import torch, torchaudio; print("torch", torch.__version__, "torchaudio", torchaudio.__version__)')"
