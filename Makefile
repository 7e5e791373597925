# The two commands a fresh machine needs (see README.md):
#   make demo   the main job
#   make test   every test, including the verbs suite on a Soft-RoCE guest when this host has no RDMA NIC
.PHONY: demo test env softroce-prereqs test-prereqs bench-notify

env:
	tools/dev_env.sh

demo: env
	.venv/bin/python examples/demo_cluster.py

softroce-prereqs:
	@if [ "$$(id -u)" = 0 ]; then tools/softroce/install.sh; \
	else echo "not root: skipping tools/softroce/install.sh (the Soft-RoCE tests need it)"; fi

test-prereqs:
	tools/install_test_prereqs.sh

test: softroce-prereqs test-prereqs env
	.venv/bin/python -m pytest tests

# WRITE_WITH_IMM (completion events / CQ polling) vs WRITE + polled trailing flag: latency and
# throughput per message size (tools/bench/write_notify.cc). Runs natively when this host has an
# RDMA device (give BENCH_NOTIFY_ARGS="--ip <address of the RDMA interface>"), else in the
# Soft-RoCE guest. E.g. make bench-notify BENCH_NOTIFY_ARGS="--json --rounds 2"
BENCH_NOTIFY_ARGS ?=
build/write_notify: tools/bench/write_notify.cc
	mkdir -p build
	g++ -O2 -std=c++17 -Wall -Wextra -o $@ $< -lrdmacm -libverbs

bench-notify: build/write_notify
	@if python3 -c 'import sys; sys.path.insert(0, "tools/softroce"); import guest; sys.exit(0 if guest.native_rdma_available() else 1)'; then \
		build/write_notify $(BENCH_NOTIFY_ARGS); \
	else \
		python3 tools/softroce/guest.py run --timeout 600 --cwd $(CURDIR) -- $(CURDIR)/build/write_notify $(BENCH_NOTIFY_ARGS); \
	fi
