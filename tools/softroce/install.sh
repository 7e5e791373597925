#!/usr/bin/env bash
# Install what the Soft-RoCE guest harness (tools/softroce/guest.py) needs.
# Run as root. Idempotent: exits quickly when everything is already installed.
set -euo pipefail

PACKAGES=(
  qemu-system-x86      # qemu-system-x86_64 (TCG)
  qemu-system-data     # /usr/share/qemu/qboot.rom
  linux-image-amd64    # Debian kernel with rdma_rxe.ko
  kmod                 # modprobe --show-depends for the initramfs
  busybox-static       # the initramfs shell
  cpio
  rdma-core
  ibverbs-utils        # ibv_devices, ibv_devinfo
  ibverbs-providers    # librxe provider
  libibverbs-dev
  librdmacm-dev
  perftest             # ib_write_bw & co
  rdmacm-utils         # rping
  iproute2             # ip, rdma
  python3-pyverbs      # the hostile verbs peer of tests/transport/verbs (Debian's python3)
)

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q '^install ok installed$'; then
    missing+=("$p")
  fi
done

if [ "${#missing[@]}" -eq 0 ]; then
  echo "softroce: all packages already installed"
  exit 0
fi

if [ "$(id -u)" -ne 0 ]; then
  echo "softroce: missing packages: ${missing[*]}; run this script as root" >&2
  exit 1
fi

echo "softroce: installing: ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
apt-get install -y -q --no-install-recommends "${missing[@]}"
echo "softroce: done"
