# The two commands a fresh machine needs (see README.md):
#   make demo   the main job
#   make test   every test, including the verbs suite on a Soft-RoCE guest when this host has no RDMA NIC
.PHONY: demo test env softroce-prereqs

env:
	tools/dev_env.sh

demo: env
	.venv/bin/python examples/demo_cluster.py

softroce-prereqs:
	@if [ "$$(id -u)" = 0 ]; then tools/softroce/install.sh; \
	else echo "not root: skipping tools/softroce/install.sh (the Soft-RoCE tests need it)"; fi

test: softroce-prereqs env
	.venv/bin/python -m pytest tests
