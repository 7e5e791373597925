#!/usr/bin/env bash
# Debian packages the test suite uses beyond the Soft-RoCE guest's (tools/softroce/install.sh):
#   ccache     tests/tensorflow_versions rebuilds tf_rdma into one venv per supported TensorFlow;
#              through ccache an unchanged tree rebuilds in seconds, in any checkout
#   util-linux prlimit and setpriv (tests/test_doctor.py lowers `ulimit -l` without CAP_IPC_LOCK)
#   libgtest-dev GoogleTest for the C++ unit tests (tests/transport/cc, `make cc-tests`)
#   clang, libclang-rt-dev  clang and its sanitizer and libFuzzer runtimes: the sanitizer builds
#              (`make sanitizers`, tools/sanitizers) and the fuzz targets (tests/fuzz, `make fuzz`)
#   llvm       llvm-symbolizer: their reports name functions and lines
#   lld        LLVM's linker for the test programs (C++ unit tests, sanitizer builds, fuzz targets):
#              about a second against libtensorflow_cc where GNU ld takes 8-12 s
#   openssl    `openssl rand` (tests/transport/test_config.py: its secrets pass tf_rdma's rule)
#   iproute2   ip netns and veth pairs (tests/faults puts each task in a network namespace)
#   nftables   nft: tests/faults cuts and thins those links (this kernel has no sch_netem for tc)
#   iptables   iptables-legacy: tests/faults delays those links through an NFQUEUE rule and a
#              userspace delayer (tests/harness/netns.py; no sch_netem, and no nft queue expression)
#   bazel-bootstrap, bazel-rules-java  Bazel 4.2 and the rules_java it loads, for `make bazel`
#              (tools/bazel/check.sh builds BUILD offline)
# Run as root (CI is); idempotent: exits at once when everything is there.
set -euo pipefail
PACKAGES=(ccache util-linux libgtest-dev clang libclang-rt-dev llvm lld openssl iproute2 nftables iptables bazel-bootstrap bazel-rules-java)
missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q '^install ok installed$' || missing+=("$p")
done
[ "${#missing[@]}" -eq 0 ] && exit 0
if [ "$(id -u)" -ne 0 ]; then
  echo "test prerequisites missing: ${missing[*]}; install them as root (the suite runs slower without ccache)" >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
apt-get install -y -q --no-install-recommends "${missing[@]}"
