"""tf_rdma's traffic as TensorBoard scalars, from Keras training.

    callback = tf_rdma.keras.StatsCallback(log_dir, every_n_steps=100)
    model.fit(..., callbacks=[callback])          # or, in a custom loop: callback.write(step)

Every `every_n_steps` training batches (and when training ends) it writes, per peer task of this
process's tf_rdma server, under `tf_rdma/<peer>/`:
  sent_bytes_per_second, received_bytes_per_second   over the batches since the last write
  regrants, errors                                    totals since the server started
and `tf_rdma/left_on_grpc/<reason>`: transfers that stayed on gRPC, by reason (totals). A peer is
named by job and task (`ps.0`, `worker.1`; `worker.r1.0` for replica 1).

It works with Keras 2 (`tf_keras`) and Keras 3 alike.
"""
import logging
import os
import re
import time

from tf_rdma.errors import ConfigError

_log = logging.getLogger(__name__)

_TASK = re.compile(r"^/job:(?P<job>[^/]+)/replica:(?P<replica>\d+)/task:(?P<task>\d+)$")


def peer_label(task):
    """A task name as a TensorBoard tag component: `/job:ps/replica:0/task:1` -> `ps.1`."""
    match = _TASK.match(task)
    if match is None:
        return re.sub(r"[^A-Za-z0-9_.\-]+", "_", task).strip("_") or "unnamed"
    replica = match["replica"]
    return ".".join([match["job"], *([] if replica == "0" else [f"r{replica}"]), match["task"]])


class _Rates:
    """Bytes per second each way per peer, between successive snapshots of stats()."""

    def __init__(self):
        self._last = None  # (time, {(server, peer): (bytes sent, bytes received)})

    def update(self, records, now):
        totals = {(record["task"], peer): (counts["bytes_sent"], counts["bytes_received"])
                  for record in records for peer, counts in record["peers"].items()}
        last, self._last = self._last, (now, totals)
        if last is None or now <= last[0]:
            return {}
        seconds = now - last[0]
        rates = {}
        for key, now_totals in totals.items():
            before = last[1].get(key, (0, 0))
            # reset_stats() in between makes a total go down: the interval starts from zero then.
            rates[key] = tuple((total - earlier if total >= earlier else total) / seconds
                               for total, earlier in zip(now_totals, before))
        return rates


class StatsCallback:
    """Writes tf_rdma's per-peer traffic as TensorBoard scalars every `every_n_steps` training
    batches and when a fit ends (the module's docstring lists them).

    Keras 2 (tf_keras) and Keras 3 both call a callback's hooks by name, so this class subclasses
    neither and works with whichever Keras the model comes from, whatever was imported first."""

    # tf_keras: the logs are never read, so they may stay tensors; False would copy them to NumPy
    # after every batch (a wait for the step), and fit under ParameterServerStrategy refuses such
    # a callback.
    _supports_tf_logs = True

    def __init__(self, log_dir, every_n_steps=100):
        if not isinstance(every_n_steps, int) or isinstance(every_n_steps, bool) or every_n_steps < 1:
            raise ConfigError(f"every_n_steps must be a whole number of at least 1, not {every_n_steps!r}")
        try:
            import tensorboard  # noqa: F401  (tf.summary writes nothing without it)
        except ImportError as error:
            raise ImportError("tf_rdma.keras.StatsCallback writes TensorBoard event files, which needs "
                              "TensorBoard: pip install tensorboard") from error
        self.log_dir = os.fspath(log_dir)
        self.every_n_steps = every_n_steps
        self.model = None
        self.params = {}
        self._writer = None
        self._rates = _Rates()
        self._step = 0
        self._warned_no_server = False
        # The server whose scalars go under tf_rdma/ directly, fixed at the first write: a record
        # that appears later (stats() adds the tf.data trainer's once one of its reads fell back)
        # must not move every tag. None until then; "" (no task) when several servers wrote.
        self._main_task = None

    def set_params(self, params):
        self.params = params

    def set_model(self, model):
        self.model = model

    def _implements_train_batch_hooks(self):
        return True

    def _implements_test_batch_hooks(self):
        return False

    def _implements_predict_batch_hooks(self):
        return False

    def _nothing(self, *args, **kwargs):
        pass

    on_epoch_begin = on_epoch_end = on_batch_begin = on_batch_end = on_train_batch_begin = _nothing
    on_test_begin = on_test_end = on_test_batch_begin = on_test_batch_end = _nothing
    on_predict_begin = on_predict_end = on_predict_batch_begin = on_predict_batch_end = _nothing

    def on_train_begin(self, logs=None):
        # The interval of the first rates starts here, not at the first write.
        self._rates.update(_stats_records(), time.monotonic())

    def on_train_batch_end(self, batch, logs=None):
        self._step += 1
        if self._step % self.every_n_steps == 0:
            self.write(self._step)

    def on_train_end(self, logs=None):
        if self._step % self.every_n_steps != 0:
            self.write(self._step)

    def write(self, step):
        """Writes the scalars for training step `step` now (for custom training loops: the rates
        of the first call's interval need an earlier call, or on_train_begin)."""
        import tensorflow as tf
        records = _stats_records()
        rates = self._rates.update(records, time.monotonic())
        if not records:
            if not self._warned_no_server:
                _log.warning("tf_rdma.keras.StatsCallback: no tf_rdma server runs in this process, "
                             "so there is nothing to write to %s", self.log_dir)
                self._warned_no_server = True
            return
        if self._main_task is None:
            self._main_task = records[0]["task"] if len(records) == 1 else ""
        if self._writer is None:
            self._writer = tf.summary.create_file_writer(self.log_dir)
        with self._writer.as_default(step=step):
            for record in records:
                prefix = "tf_rdma/" + ("" if record["task"] == self._main_task else peer_label(record["task"]) + "/")
                for peer, counts in record["peers"].items():
                    tag = prefix + peer_label(peer)
                    sent, received = rates.get((record["task"], peer), (None, None))
                    if sent is not None:
                        tf.summary.scalar(tag + "/sent_bytes_per_second", sent)
                        tf.summary.scalar(tag + "/received_bytes_per_second", received)
                    tf.summary.scalar(tag + "/regrants", counts["regrants"])
                    tf.summary.scalar(tag + "/errors", counts["errors"])
                for reason, transfers in record["fallback"].items():
                    tf.summary.scalar(prefix + "left_on_grpc/" + peer_label(reason), transfers)
        self._writer.flush()


def _stats_records():
    from tf_rdma import server
    return server.stats_records()
