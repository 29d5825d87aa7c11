#!/usr/bin/env bash
# Builds and installs Horovod 0.28.1 (Gloo, CPU, TensorFlow only) into the CURRENT Python, against
# the TensorFlow already installed there (2.21), for NestPipeStrategy(collectives="horovod").
#
# usage: scripts/install_horovod.sh            (root, or sudo for apt-get; ~2.5 min on 2 cores)
#
# Idempotent: exits at once when `import horovod.tensorflow` already works. Horovod 0.28.1 is
# source only and needs two workarounds to compile against TF 2.21:
#   * TF 2.21's wheel lacks the highwayhash / farmhash headers its own headers include:
#     Debian's libhighwayhash-dev and libfarmhash-dev provide them;
#   * horovod/tensorflow/xla_mpi_ops.cc includes tensorflow/compiler/xla/client/xla_builder.h,
#     which TF 2.19 moved to xla/hlo/builder/xla_builder.h: a one-line header at the old path
#     (in a temporary directory put on CPLUS_INCLUDE_PATH) includes the new one.
# TensorFlow is pinned with a constraints file so pip can never replace it.
set -euo pipefail

PYTHON=${PYTHON:-python}
HOROVOD_VERSION=${HOROVOD_VERSION:-0.28.1}

if "$PYTHON" -c "import horovod.tensorflow" >/dev/null 2>&1; then
  echo "[install_horovod] horovod.tensorflow already imports ($("$PYTHON" -c 'import horovod; print(horovod.__version__)')); nothing to do"
  exit 0
fi

TF_VERSION=$("$PYTHON" -c "import tensorflow as tf; print(tf.__version__)" 2>/dev/null) || {
  echo "[install_horovod] TensorFlow is not importable by $PYTHON: install the project first" >&2
  echo "  (pip install -r requirements.txt && pip install --no-build-isolation -e .)" >&2
  exit 1
}
echo "[install_horovod] building horovod==$HOROVOD_VERSION against tensorflow==$TF_VERSION"

# Header packages TF 2.21's own headers need (absent from its wheel).
need=()
for pkg in libhighwayhash-dev libfarmhash-dev; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
done
if [ ${#need[@]} -gt 0 ]; then
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}"
fi
for tool in cmake g++ make; do
  command -v "$tool" >/dev/null || { echo "[install_horovod] $tool is required" >&2; exit 1; }
done

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK/include/tensorflow/compiler/xla/client"
cat > "$WORK/include/tensorflow/compiler/xla/client/xla_builder.h" <<'EOF'
// TF >= 2.19 moved this header; horovod 0.28.1's xla_mpi_ops.cc still includes the old path.
#include "xla/hlo/builder/xla_builder.h"
EOF
echo "tensorflow==$TF_VERSION" > "$WORK/constraints.txt"

export CPLUS_INCLUDE_PATH="$WORK/include${CPLUS_INCLUDE_PATH:+:$CPLUS_INCLUDE_PATH}"
export HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 \
       HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 HOROVOD_CPU_OPERATIONS=GLOO
export MAKEFLAGS=${MAKEFLAGS:--j2}

start=$(date +%s)
"$PYTHON" -m pip install --no-build-isolation --no-cache-dir -c "$WORK/constraints.txt" \
  "horovod==$HOROVOD_VERSION"
echo "[install_horovod] build + install took $(( $(date +%s) - start )) s"

"$PYTHON" -c "import tensorflow as tf; assert tf.__version__ == '$TF_VERSION', tf.__version__"
"$PYTHON" -c "import horovod, horovod.tensorflow as hvd; print('[install_horovod] horovod', horovod.__version__, 'gloo built:', hvd.gloo_built())"
HOROVODRUN=$(dirname "$("$PYTHON" -c 'import sys; print(sys.executable)')")/horovodrun
[ -x "$HOROVODRUN" ] || HOROVODRUN=horovodrun
"$HOROVODRUN" --check-build
