"""`python -m tf_rdma bench transport|tf|collective|data|scale`: each bench a module here, measured
against stock gRPC and the machine's limits in the same run. _common holds what they share; the
others build on transport's baselines (limits), not on each other."""
