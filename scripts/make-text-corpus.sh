#!/usr/bin/env bash
# Writes a ~1 MB English text for comparing recipes on real prose (docs/benchmarks.md): the Vim
# user manual and reference chapters from Debian's vim-runtime package, concatenated in a fixed
# order and cut at 1,000,000 bytes. The same package version gives the same bytes; the recipe
# table records the file's SHA-256. Usage: scripts/make-text-corpus.sh [OUT] (default
# .carry/text/en.txt, a folder the device tool can carry to the GPU machine).
set -euo pipefail
out=${1:-.carry/text/en.txt}
doc=/usr/share/vim/vim90/doc
if [ ! -f "$doc/usr_01.txt" ]; then
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends vim-runtime >/dev/null
fi
mkdir -p "$(dirname "$out")"
cat "$doc"/usr_*.txt "$doc"/intro.txt "$doc"/starting.txt "$doc"/editing.txt "$doc"/motion.txt \
    "$doc"/change.txt "$doc"/undo.txt "$doc"/insert.txt "$doc"/pattern.txt > "$out"
truncate -s 1000000 "$out"
echo "make-text-corpus: $out ($(wc -c < "$out") bytes, sha256 $(sha256sum "$out" | cut -c1-16)...)"
