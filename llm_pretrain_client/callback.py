"""The client under `Model.train` — what MindFormers' Trainer calls — as a MindSpore Callback: each step begun
and ended through the client (llm_pretrain_client.client), a stop asked of the model when the daemon's commands,
a signal or the run's end say so, the rest of the run's bookkeeping at the end of training.

    client = Client()
    train_net = nn.TrainOneStepCell(nn.WithLossCell(net, loss_fn), optimizer)
    client.restore(train_net.get_parameters())
    dataset = ds.GeneratorDataset(client.source(samples, vocab_size=V), ["input_ids", "labels"]).batch(micro)
    Model(train_net).train(1, dataset, callbacks=[Supervisor(client)], dataset_sink_mode=False)

The step's outputs (`cb_params.net_outputs`) are read as the training cell returns them: a loss; or (loss,
overflow, loss scale) from TrainOneStepWithLossScaleCell (MindFormers' MFTrainOneStepCell too); or the fields
`outputs` names, e.g. ("loss", "grad_norm") for a cell of the script's own that returns its global norm.
"""
from __future__ import annotations

from typing import Sequence

from mindspore.train.callback import Callback

FIELDS = ("loss", "overflow", "loss_scale", "grad_norm", "lr")


class Supervisor(Callback):
    def __init__(self, client, *, outputs: Sequence[str] | None = None):
        super().__init__()
        unknown = [f for f in outputs or () if f not in FIELDS]
        if unknown:
            raise ValueError(f"outputs names {unknown}: each must be one of {', '.join(FIELDS)}")
        self.client, self.outputs = client, tuple(outputs) if outputs else None
        if self.outputs:
            client._claims["grad_norm"] |= "grad_norm" in self.outputs
            client._claims["loss_scale"] |= "loss_scale" in self.outputs
            client._claims["lr"] |= "lr" in self.outputs

    def _fields(self, outputs) -> dict:
        if not isinstance(outputs, (tuple, list)):
            return {"loss": outputs}
        names = self.outputs or (("loss", "overflow", "loss_scale") if len(outputs) == 3 else ("loss",))
        return dict(zip(names, outputs))

    def on_train_begin(self, run_context):
        cb = run_context.original_args()
        network = getattr(cb, "train_network", None)
        if not self.outputs and network is not None and hasattr(network, "scale_sense"):   # a loss-scale cell
            self.client._claims["loss_scale"] = True
            if self.client.loss_scale_param is None:
                self.client.loss_scale_param = network.scale_sense

    def on_train_step_begin(self, run_context):
        self.client.begin_step()

    def on_train_step_end(self, run_context):
        fields = self._fields(run_context.original_args().net_outputs)
        go_on = self.client.end_step(fields["loss"], grad_norm=fields.get("grad_norm"),
                                     loss_scale=fields.get("loss_scale"), overflow=fields.get("overflow", False),
                                     lr=None if fields.get("lr") is None else float(fields["lr"].asnumpy()))
        if not go_on:
            run_context.request_stop()

    def on_train_end(self, run_context):
        self.client.finish()
