"""What the tests run beside tf_rdma and do not ship with it: networks of namespaces with faults on
their links (netns, nfqueue_delay; root), and the soak and chaos runs (`python -m tests.harness
soak|chaos` from the repository's root)."""
