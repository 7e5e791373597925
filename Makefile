# The two commands a fresh machine needs (see README.md):
#   make demo   the main job
#   make test   every test, including the verbs suite on a Soft-RoCE guest when this host has no RDMA NIC
# and the one to run on every change:
#   make check  the fast tier (a few minutes): C++ unit tests of the pure code, the transport's
#               contract over tcp and shm, config and README checks, one TensorFlow session
.PHONY: demo test check cc-tests fuzz fuzz-build fuzz-seeds bazel env softroce-prereqs test-prereqs bench-notify

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

# Two lanes at once (tools/run_tests.sh): tests/softroce's guests, and beside them the C++,
# sanitizer, fuzz and Bazel stages, then every other pytest file in two pytest-xdist workers.
# --durations: the log shows where each lane's time went.
test: softroce-prereqs test-prereqs env
	tools/run_tests.sh

CHECK_TESTS = tests/test_readme.py tests/transport/test_config.py tests/transport/test_transport.py \
	tests/transport/test_wire_robustness.py tests/tf/test_tf1.py::test_tasks_sharing_a_secret_exchange_tensors \
	tests/tf/test_in_process.py::test_the_python_bindings_count_tensorflows_connections \
	tests/tf/test_coordinator_failures.py

check: test-prereqs env cc-tests
	.venv/bin/python -m pytest -q $(CHECK_TESTS)

# The test programs link against libtensorflow_cc (790 MB): LLVM's lld takes about a second where
# GNU ld takes 8-12 s, for each of a dozen programs (tools/install_test_prereqs.sh installs lld;
# without it, GNU ld). The package's own extensions link as pip links them, with the default linker.
TEST_LINKER = $(if $(shell command -v ld.lld),-fuse-ld=lld)

# C++ unit tests (GoogleTest, Debian's libgtest-dev) of the transport's pure code, against the
# absl of the TensorFlow in .venv, as the extensions are built.
TF_FLAGS = $(shell .venv/bin/python -c 'import tensorflow as tf; print(*tf.sysconfig.get_compile_flags(), *tf.sysconfig.get_link_flags(), "-Wl,-rpath," + tf.sysconfig.get_lib())' 2>/dev/null)
# They link the transport core as the package built it (libtf_rdma_transport.so, which env builds),
# as the sanitizer builds link theirs: its files are compiled once per build, not again for them.
CC_TEST_SOURCES = $(wildcard tests/transport/cc/*_test.cc)
build/transport_unit_tests: $(CC_TEST_SOURCES) $(wildcard cc/transport/*.h cc/transport/stream/*.h) | env
	mkdir -p build
	g++ -DNDEBUG -O1 -Wall -I. $(TEST_LINKER) -o $@ $(CC_TEST_SOURCES) -lgtest -lgtest_main -pthread -ldl $(TF_FLAGS) \
		-L$(CURDIR)/tf_rdma -l:libtf_rdma_transport.so -Wl,-rpath,$(CURDIR)/tf_rdma

# The tf.data element messages (cc/tf/data/, built for the TensorFlow releases setup.py names in
# DATA_SERVICE_TENSORFLOW) decoded from a hostile peer, a peer's receive pool
# (cc/tf/runtime/buffer_pool.h), and control calls over real connections (cc/tf/calls/), against
# the TensorFlow in .venv.
TF_INCLUDE = $(shell .venv/bin/python -c 'import tensorflow as tf; print(tf.sysconfig.get_include())' 2>/dev/null)
TF_CC_TEST_SOURCES = $(wildcard tests/tf/cc/*_test.cc) cc/tf/data/element_message.cc \
	cc/tf/messages/tensor_message.cc cc/tf/messages/call_message.cc cc/tf/calls/call_channel.cc cc/tf/calls/call_timer.cc \
	cc/tf/calls/run_graph_ids.cc \
	cc/tf/runtime/buffer_pool.cc
# The control calls' tests run over real connections: the transport library env built.
build/tf_unit_tests: $(TF_CC_TEST_SOURCES) $(wildcard cc/tf/data/*.h cc/tf/messages/*.h cc/tf/calls/*.h cc/tf/runtime/*.h) | env
	mkdir -p build
	g++ -DNDEBUG -O1 -Wall -Wno-sign-compare -Wno-deprecated-declarations -I. -I$(TF_INCLUDE)/external/com_google_protobuf/src $(TEST_LINKER) -o $@ \
		$(TF_CC_TEST_SOURCES) -lgtest -lgtest_main -pthread $(TF_FLAGS) -l:libtensorflow_cc.so.2 \
		-L$(CURDIR)/tf_rdma -l:libtf_rdma_transport.so -Wl,-rpath,$(CURDIR)/tf_rdma -ldl

# BUILD checked: Debian's Bazel builds every target offline against .venv's TensorFlow, then the
# C++ unit tests it built, the transport contract and a TensorFlow session run on its extensions.
bazel: test-prereqs env
	tools/bazel/check.sh

# The two binaries build side by side (a compiler each, a minute apiece on one core); env ran first.
cc-tests: env
	$(MAKE) --no-print-directory -j2 -o env build/transport_unit_tests build/tf_unit_tests
	build/transport_unit_tests --gtest_brief=1
	build/tf_unit_tests --gtest_brief=1

# The transport built with clang under AddressSanitizer + UndefinedBehaviorSanitizer (build/asan/)
# and apart under ThreadSanitizer (build/tsan/), its C++ unit tests and its Python suites run
# against each (tools/sanitizers, docs/testing.md). Sized for about 5 minutes on 2 cores, builds
# through ccache included: a shorter fuzz campaign under ASan, the threaded cases under TSan.
.PHONY: sanitizers
SANITIZER_RUN = .venv/bin/python -m tools.sanitizers
ASAN_PYTESTS = tests/transport/test_transport.py tests/transport/test_adversarial.py \
	tests/transport/test_wire_robustness.py
ASAN_FUZZ = FUZZ_FRAMES=400 FUZZ_HANDSHAKE_FRAMES=60
TSAN_PYTESTS = tests/transport/test_transport.py
sanitizers: test-prereqs env
	$(SANITIZER_RUN) build asan $(CC_TEST_SOURCES)
	$(SANITIZER_RUN) unit-tests asan --gtest_brief=1
	$(ASAN_FUZZ) $(SANITIZER_RUN) pytest asan -q -p no:cacheprovider $(ASAN_PYTESTS)
	$(SANITIZER_RUN) build tsan $(CC_TEST_SOURCES)
	$(SANITIZER_RUN) unit-tests tsan --gtest_brief=1
	$(SANITIZER_RUN) pytest tsan -q -p no:cacheprovider $(TSAN_PYTESTS)

# ---- fuzzing (libFuzzer, clang) ----
# Every decoder and state machine a peer drives (tests/fuzz/*_fuzz.cc), built with AddressSanitizer
# and UndefinedBehaviorSanitizer, each run for FUZZ_SECONDS (12) from its seed corpus
# (tests/fuzz/corpus/<target>, which keeps every input that once crashed it); any crash, leak,
# sanitizer report or failed check fails the build. A longer run: make fuzz FUZZ_SECONDS=600
# (docs/testing.md). New inputs go to build/fuzz/corpus/<target>, crashes to build/fuzz/crashes/.
FUZZ_SECONDS ?= 12
FUZZ_CXX ?= clang++
# TensorFlow's flags, asked of the venv's TensorFlow once per make (an import takes seconds).
FUZZ_TF_CFLAGS = $(eval FUZZ_TF_CFLAGS := $$(shell .venv/bin/python -c 'import tensorflow as tf; \
	print(*tf.sysconfig.get_compile_flags(), "-I" + tf.sysconfig.get_include() + "/external/com_google_protobuf/src")' \
	2>/dev/null))$(FUZZ_TF_CFLAGS)
FUZZ_TF_LDFLAGS = $(eval FUZZ_TF_LDFLAGS := $$(shell .venv/bin/python -c 'import tensorflow as tf; \
	print(*tf.sysconfig.get_link_flags(), "-Wl,-rpath," + tf.sysconfig.get_lib())' 2>/dev/null))$(FUZZ_TF_LDFLAGS)
FUZZ_TARGETS = $(patsubst tests/fuzz/%_fuzz.cc,%,$(wildcard tests/fuzz/*_fuzz.cc))
FUZZ_CFLAGS = -g -O1 -DNDEBUG -Wall -Wno-sign-compare -Wno-deprecated-declarations -I. \
	-fsanitize=address,undefined -fno-sanitize-recover=all
# The transport core and the TensorFlow-side code the targets reach, instrumented for coverage; each
# compiled as one unity unit, as setup.py compiles the extensions: the headers (TensorFlow's above
# all) are most of each file's compile time, and a unit pays for them once (the two side by side).
FUZZ_TRANSPORT_SOURCES = $(sort $(wildcard cc/transport/*.cc cc/transport/stream/*.cc cc/transport/tcp/*.cc \
	cc/transport/shm/*.cc))
FUZZ_TENSORFLOW_SOURCES = cc/tf/messages/tensor_message.cc cc/tf/data/element_message.cc \
	cc/tf/messages/call_message.cc cc/tf/calls/call_channel.cc cc/tf/planning/fusion.cc $(sort $(wildcard cc/tf/runtime/*.cc))
# A unit is written again only when its list of files changed (one removed too); its object is
# compiled again when the unit or any file it includes changed.
build/fuzz/obj/transport.o: $(FUZZ_TRANSPORT_SOURCES)
build/fuzz/obj/tensorflow_side.o: $(FUZZ_TENSORFLOW_SOURCES)
build/fuzz/units/%.cc: FORCE
	@mkdir -p $(dir $@)
	@printf '#include "%s"\n' $(filter %.cc,$(FUZZ_$*_SOURCES)) > $@.new
	@if cmp -s $@.new $@; then rm $@.new; else mv $@.new $@; fi
.PHONY: FORCE
FUZZ_transport_SOURCES = $(FUZZ_TRANSPORT_SOURCES)
FUZZ_tensorflow_side_SOURCES = $(FUZZ_TENSORFLOW_SOURCES)
build/fuzz/obj/%.o: build/fuzz/units/%.cc $(wildcard cc/*/*.h cc/*/*/*.h) | env
	@mkdir -p $(dir $@)
	$(FUZZ_CXX) $(FUZZ_CFLAGS) $(FUZZ_TF_CFLAGS) -fsanitize=fuzzer-no-link -c -o $@ $<
build/fuzz/libtf_rdma_fuzz.a: build/fuzz/obj/transport.o build/fuzz/obj/tensorflow_side.o
	rm -f $@ && ar rcs $@ $^
# libtensorflow_cc is linked even where no symbol of it is named: it registers the protos the
# tf.data messages parse (tensorflow.data.GetElementRequest). libcrypto comes before TensorFlow's
# libraries: a sanitized build loads it without RTLD_DEEPBIND (cc/transport/crypto.cc), and its calls
# to its own functions would otherwise bind to the BoringSSL functions of the same names that
# libtensorflow_framework exports (the handshake target died in HMAC's self-test).
build/fuzz/%_fuzz: tests/fuzz/%_fuzz.cc $(wildcard tests/fuzz/*.h) build/fuzz/libtf_rdma_fuzz.a
	$(FUZZ_CXX) $(FUZZ_CFLAGS) $(FUZZ_TF_CFLAGS) $(TEST_LINKER) -fsanitize=fuzzer -o $@ $< build/fuzz/libtf_rdma_fuzz.a \
		-pthread -ldl -Wl,--no-as-needed -l:libcrypto.so.3 $(FUZZ_TF_LDFLAGS) -l:libtensorflow_cc.so.2
# The seeds made by real encoders (tests/fuzz/write_seeds.cc), to rewrite after a format changed.
build/fuzz/write_seeds: tests/fuzz/write_seeds.cc build/fuzz/libtf_rdma_fuzz.a
	$(FUZZ_CXX) $(FUZZ_CFLAGS) $(FUZZ_TF_CFLAGS) $(TEST_LINKER) -fsanitize=fuzzer-no-link -o $@ $< build/fuzz/libtf_rdma_fuzz.a \
		-pthread -ldl -Wl,--no-as-needed -l:libcrypto.so.3 $(FUZZ_TF_LDFLAGS) -l:libtensorflow_cc.so.2
fuzz-seeds: build/fuzz/write_seeds
	build/fuzz/write_seeds tests/fuzz/corpus
fuzz-build: test-prereqs env
	$(MAKE) --no-print-directory -j2 -o env $(patsubst %,build/fuzz/%_fuzz,$(FUZZ_TARGETS))
# Two campaigns at a time: each is one thread, and the machine has two cores. Each campaign's
# lines (a failing one's log tail too) are printed together, when it ends.
fuzz: fuzz-build
	@mkdir -p build/fuzz/crashes
	@$(MAKE) --no-print-directory -j2 --output-sync=target $(patsubst %,fuzz-run-%,$(FUZZ_TARGETS))
fuzz-run-%:
	@mkdir -p build/fuzz/corpus/$*
	@echo "fuzz: $* for $(FUZZ_SECONDS) s"
	@build/fuzz/$*_fuzz -max_total_time=$(FUZZ_SECONDS) -print_final_stats=1 \
		-artifact_prefix=build/fuzz/crashes/$*- build/fuzz/corpus/$* \
		tests/fuzz/corpus/$* 2>build/fuzz/$*.log \
		|| { tail -n 60 build/fuzz/$*.log; exit 1; }
	@echo "fuzz: $* $$(grep -E '^stat::number_of_executed_units' build/fuzz/$*.log)"

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
