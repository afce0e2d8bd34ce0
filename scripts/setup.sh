#!/usr/bin/env bash
# One set-up step for a fresh machine, CI and developers alike. Idempotent: a second run
# only checks what is there and returns in seconds.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

# --- Debian packages: the real MQTT broker and the speech synthesisers for the corpus.
# festival, RHVoice and MBROLA and their voices are speech engines of the pretraining corpus
# and its add-ons; tools/CORPUS.md lists each voice with its licence.
# nodejs runs GnuSpeech (below).
apt_pkgs=(mosquitto mosquitto-clients espeak-ng flite festival festvox-kallpc16k festvox-kdlpc16k
          festvox-us-slt-hts libsndfile1 openssl nodejs)
# From Debian's contrib and non-free components (RHVoice, the MBROLA voice databases and the
# festival voices that need the OALD lexicon or MBROLA).
extra_pkgs=(rhvoice rhvoice-english mbrola mbrola-us1 mbrola-us2 mbrola-us3 mbrola-en1
            mbrola-de1 mbrola-de2 mbrola-nl2 mbrola-fr1 mbrola-fr4 mbrola-sw2 mbrola-pl1
            mbrola-hu1 festlex-oald festvox-rablpc16k festvox-don festvox-us1 festvox-us2
            festvox-us3 festvox-en1)
missing=()
for p in "${apt_pkgs[@]}" "${extra_pkgs[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
    echo "[setup] installing Debian packages: ${missing[*]}"
    sudo_cmd=""
    [ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
    # A new Debian machine lists only the `main` component: add contrib and non-free from the
    # same mirror and suites as its own `main` entry (deb822 or one-line format).
    extra_list=/etc/apt/sources.list.d/wakefl-contrib-non-free.sources
    if [ ! -f "$extra_list" ] && ! grep -rqs "contrib" /etc/apt/sources.list /etc/apt/sources.list.d/; then
        mirror=$(grep -hs "^URIs:" /etc/apt/sources.list.d/*.sources | grep -v security | head -1 | awk '{print $2}')
        [ -n "$mirror" ] || mirror=$(grep -hs "^deb " /etc/apt/sources.list | grep -v security | head -1 | awk '{print $2}')
        codename=$(. /etc/os-release && echo "${VERSION_CODENAME:-bookworm}")
        printf 'Types: deb\nURIs: %s\nSuites: %s %s-updates\nComponents: contrib non-free\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' \
            "${mirror:-http://deb.debian.org/debian}" "$codename" "$codename" | $sudo_cmd tee "$extra_list" >/dev/null
    fi
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
extras="full,dev,peers"  # peers: the side-by-side benchmark's detectors, so its tests run
want="$( (cat pyproject.toml; echo "$extras") | sha256sum | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    echo "[setup] installing wakefl and its pinned dependencies into .venv (first time: several minutes)"
    # Machine-wide pip settings may name local index folders that do not exist; their
    # warnings are noise here.
    quiet_pip() { .venv/bin/python -m pip "$@" 2> >(grep -v "is ignored: it is neither" >&2); }
    quiet_pip install -q --upgrade "pip==26.3" "setuptools==80.9.0" wheel
    # setuptools' editable install notes that a folder named like the package may shadow it;
    # here the folder `wakefl/` is the package itself (pyproject's package-dir), so the note
    # does not apply and is not printed.
    PYTHONWARNINGS="ignore:Editable installation" quiet_pip install -q -e ".[$extras]"
    echo "$want" >"$stamp"
fi
# --- GnuSpeech (articulatory synthesis, tools/corpus/gnuspeech.py): its WebAssembly package
# and one dependency, pinned by the registry's integrity hashes, into .venv/share. Without
# it the corpus has one engine less and its tests say why they skip, so a failed download
# is a warning, not the end of the set-up.
if ! .venv/bin/python scripts/install_gnuspeech.py; then
    echo "[setup] warning: GnuSpeech was not installed (see above); its voices are unavailable" >&2
fi
echo "[setup] ready: $(.venv/bin/python -c 'import torch, torchaudio; print("torch", torch.__version__, "torchaudio", torchaudio.__version__)')"
