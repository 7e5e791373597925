"""TF2 coordinator for test_keras_fit.py: Keras 2 (tf_keras) `model.fit` under tf_rdma's
ParameterServerStrategy. `python keras_fit_coordinator.py JSON_ARGS` with the JSON of
{"cluster": {...}, "output": path, "transport": "rdma"|"grpc", "epochs": n, "steps_per_epoch": n}.

Keras 3 (TensorFlow 2.16+'s default) cannot fit under ParameterServerStrategy; Keras 2 can, given a
DatasetCreator and steps_per_epoch. Its History (per-epoch loss) is written to `output`."""
import json
import os
import sys


def main(cluster, output, transport="rdma", epochs=3, steps_per_epoch=20):
    import tensorflow as tf
    import tf_keras as keras

    from tests.tf.programs.tasks import classification_set, ps_strategy
    strategy = ps_strategy(cluster, transport)
    features, labels = classification_set()

    def dataset_fn(input_context):
        ds = tf.data.Dataset.from_tensor_slices((features, labels)).shuffle(len(labels), seed=0)
        ds = ds.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
        return ds.repeat().batch(64, drop_remainder=True).prefetch(2)

    with strategy.scope():  # the variables (model's and SGD's) are created on the ps
        model = keras.Sequential([
            keras.Input((64,)),
            keras.layers.Dense(256, activation="relu",
                               kernel_initializer=keras.initializers.GlorotUniform(1)),
            keras.layers.Dense(10, kernel_initializer=keras.initializers.GlorotUniform(2)),
        ])
        model.compile(optimizer=keras.optimizers.SGD(0.1),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = model.fit(keras.utils.experimental.DatasetCreator(dataset_fn), epochs=epochs,
                        steps_per_epoch=steps_per_epoch, verbose=2)
    result = {
        "loss": [float(x) for x in history.history["loss"]],
        "iterations": int(model.optimizer.iterations.numpy()),
        "devices": sorted({v.device for v in model.weights}),
    }
    with open(output, "w") as f:
        json.dump(result, f)
    print("done", result, flush=True)
    os._exit(0)  # the coordinator's threads keep polling the cluster otherwise


if __name__ == "__main__":
    main(**json.loads(sys.argv[1]))
