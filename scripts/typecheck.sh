#!/usr/bin/env bash
# mypy on the installed packages wakefl.models, wakefl.protocol, wakefl.sdk, wakefl.server,
# wakefl.edge_runtime and wakefl.tools (settings in pyproject.toml, [tool.mypy]).
#
# The folders install under the `wakefl` namespace (pyproject's package-dir), which mypy
# cannot follow through the editable install's import hook; a tree of symbolic links under
# build/ gives it the installed layout, so imports between the packages are checked.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
tree=build/mypy-tree
rm -rf "$tree"
mkdir -p "$tree/wakefl"
for f in wakefl/*.py; do
    ln -s "../../../$f" "$tree/wakefl/$(basename "$f")"
done
for pkg in models protocol sdk server edge_runtime tools; do
    ln -s "../../../$pkg" "$tree/wakefl/$pkg"
done
exec .venv/bin/mypy -p wakefl.models -p wakefl.protocol -p wakefl.sdk -p wakefl.server -p wakefl.edge_runtime -p wakefl.tools "$@"
