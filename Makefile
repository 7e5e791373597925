# The two commands a fresh machine needs (see README.md):
#   make demo   the main job
#   make test   every test, including the verbs suite on a Soft-RoCE guest when this host has no RDMA NIC
# and the one to run on every change:
#   make check  the fast tier (a few minutes): C++ unit tests of the pure code, the transport's
#               contract over tcp and shm, config and README checks, one TensorFlow session
.PHONY: demo test check cc-tests env softroce-prereqs test-prereqs bench-notify

env:
	tools/dev_env.sh

# The examples train on scikit-learn's digits, from .venv/optional (requirements-optional.txt).
demo: env
	PYTHONPATH=$(CURDIR)/.venv/optional .venv/bin/python examples/demo_cluster.py

softroce-prereqs:
	@if [ "$$(id -u)" = 0 ]; then tools/softroce/install.sh; \
	else echo "not root: skipping tools/softroce/install.sh (the Soft-RoCE tests need it)"; fi

test-prereqs:
	tools/install_test_prereqs.sh

# --durations: CI's log shows where the suite's time went (issue notes compare it with local runs).
test: softroce-prereqs test-prereqs env cc-tests
	.venv/bin/python -m pytest tests --durations=30

CHECK_TESTS = tests/test_readme.py tests/transport/test_config.py tests/transport/test_transport.py \
	tests/transport/test_wire_robustness.py tests/tf/test_tf1.py::test_tasks_sharing_a_secret_exchange_tensors \
	tests/tf/test_in_process.py::test_the_python_bindings_count_tensorflows_connections \
	tests/tf/test_coordinator_failures.py

check: test-prereqs env cc-tests
	.venv/bin/python -m pytest -q $(CHECK_TESTS)

# C++ unit tests (GoogleTest, Debian's libgtest-dev) of the transport's pure code, against the
# absl of the TensorFlow in .venv, as the extensions are built.
TF_FLAGS = $(shell .venv/bin/python -c 'import tensorflow as tf; print(*tf.sysconfig.get_compile_flags(), *tf.sysconfig.get_link_flags(), "-Wl,-rpath," + tf.sysconfig.get_lib())' 2>/dev/null)
CC_TEST_SOURCES = $(wildcard tests/transport/cc/*_test.cc) cc/transport/grant_book.cc cc/transport/wire.cc \
	cc/transport/handshake.cc cc/transport/crypto.cc cc/transport/backend_names.cc cc/transport/transport.cc cc/transport/io_loops.cc \
	cc/transport/peer_errors.cc cc/transport/stream/stream_connection.cc cc/transport/stream/socket_io.cc
build/transport_unit_tests: $(CC_TEST_SOURCES) $(wildcard cc/transport/*.h cc/transport/stream/*.h) | env
	mkdir -p build
	g++ -DNDEBUG -O1 -Wall -I. -o $@ $(CC_TEST_SOURCES) -lgtest -lgtest_main -pthread -ldl $(TF_FLAGS)

# The tf.data element messages (cc/tf/data/, built for the TensorFlow releases setup.py names in
# DATA_SERVICE_TENSORFLOW) decoded from a hostile peer, and a peer's receive pool
# (cc/tf/runtime/buffer_pool.h), against the TensorFlow in .venv.
TF_INCLUDE = $(shell .venv/bin/python -c 'import tensorflow as tf; print(tf.sysconfig.get_include())' 2>/dev/null)
TF_CC_TEST_SOURCES = $(wildcard tests/tf/cc/*_test.cc) cc/tf/data/element_message.cc \
	cc/tf/messages/tensor_message.cc cc/tf/runtime/buffer_pool.cc cc/transport/crypto.cc
build/tf_unit_tests: $(TF_CC_TEST_SOURCES) $(wildcard cc/tf/data/*.h cc/tf/messages/*.h cc/tf/runtime/*.h) | env
	mkdir -p build
	g++ -DNDEBUG -O1 -Wall -Wno-sign-compare -Wno-deprecated-declarations -I. -I$(TF_INCLUDE)/external/com_google_protobuf/src -o $@ \
		$(TF_CC_TEST_SOURCES) -lgtest -lgtest_main -pthread $(TF_FLAGS) -l:libtensorflow_cc.so.2 -ldl

# The two binaries build side by side (a compiler each, a minute apiece on one core); env ran first.
cc-tests: env
	$(MAKE) --no-print-directory -j2 -o env build/transport_unit_tests build/tf_unit_tests
	build/transport_unit_tests --gtest_brief=1
	build/tf_unit_tests --gtest_brief=1

# WRITE_WITH_IMM (completion events / CQ polling) vs WRITE + polled trailing flag: latency and
# throughput per message size (tools/bench/write_notify.cc). Runs natively when this host has an
# RDMA device (give BENCH_NOTIFY_ARGS="--ip <address of the RDMA interface>"), else in the
# Soft-RoCE guest. E.g. make bench-notify BENCH_NOTIFY_ARGS="--json --rounds 2"
BENCH_NOTIFY_ARGS ?=
build/write_notify: tools/bench/write_notify.cc
	mkdir -p build
	g++ -O2 -std=c++17 -Wall -Wextra -o $@ $< -lrdmacm -libverbs

bench-notify: build/write_notify
	@if python3 -c 'import sys; from tools.softroce import guest; sys.exit(0 if guest.native_rdma_available() else 1)'; then \
		build/write_notify $(BENCH_NOTIFY_ARGS); \
	else \
		python3 tools/softroce/guest.py run --timeout 600 --cwd $(CURDIR) -- $(CURDIR)/build/write_notify $(BENCH_NOTIFY_ARGS); \
	fi
