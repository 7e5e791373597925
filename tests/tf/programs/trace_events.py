"""tf_rdma's events in the profiles TensorFlow wrote under a log directory (the XSpace files,
`*.xplane.pb`, that TensorBoard's profile plugin reads): one dict per event, its name, duration in
microseconds and arguments (peer, backend, bytes, step_id, ...).

    python -m tests.tf.programs.trace_events LOG_DIR      # prints them as JSON
"""
import json
import sys
from pathlib import Path


def tf_rdma_events(log_dir):
    from tensorflow.tsl.profiler.protobuf import xplane_pb2
    events = []
    for path in sorted(Path(log_dir).rglob("*.xplane.pb")):
        space = xplane_pb2.XSpace.FromString(path.read_bytes())
        for plane in space.planes:
            for line in plane.lines:
                for event in line.events:
                    name = plane.event_metadata[event.metadata_id].name
                    if not name.startswith("tf_rdma "):
                        continue
                    arguments = {}
                    for stat in event.stats:
                        kind = stat.WhichOneof("value")
                        value = getattr(stat, kind)
                        if kind == "ref_value":
                            value = plane.stat_metadata[value].name
                        arguments[plane.stat_metadata[stat.metadata_id].name] = value
                    events.append({"name": name, "plane": plane.name, "thread": line.name,
                                   "duration_us": event.duration_ps / 1e6, **arguments})
    return events


if __name__ == "__main__":
    json.dump(tf_rdma_events(sys.argv[1]), sys.stdout)
