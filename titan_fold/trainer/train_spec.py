"""The TrainSpecs FoldTrainer builds from: one per model family.

`[model] name` picks the family (models/flavors.py: qwen2_moe, qwen3_moe, mixtral, deepseek_v3, gpt_oss,
qwen3_5_moe, qwen3_next), `[model] flavor` its
size: a named one (flavors.py) or `hf`, every size from the config.json at `[model] hf_config`.
"""

import copy
from collections.abc import Iterator, Mapping

from torchtitan.components.lr_scheduler import build_lr_schedulers
from torchtitan.protocols.train_spec import TrainSpec, register_train_spec

from titan_fold.data import build_dataloader, build_tokenizer
from titan_fold.models import FLAVORS, Transformer
from titan_fold.models.args import TransformerArgs
from titan_fold.models.hf_adapter import ADAPTERS
from titan_fold.models.hf_flavor import HF_ARGS, HFConfigArgs
from titan_fold.parallel.parallelize import parallelize
from titan_fold.parallel.pipeline import pipeline
from titan_fold.trainer.metrics import build_metrics_processor
from titan_fold.trainer.muon import build_optimizers
from titan_fold.trainer.policy import build_loss


class FlavorCopies(Mapping[str, TransformerArgs]):
    """A family's flavors, plus `hf`, that hand out copies.

    FoldTrainer calls update_from_config on the args it looks up; a copy keeps
    one job's `[moe]` overrides out of the next job started in the same process. The `hf`
    entry is filled from `[model] hf_config` by that same update_from_config.
    """

    def __init__(self, flavors: dict[str, TransformerArgs], hf_args: type[TransformerArgs] = HFConfigArgs):
        self._flavors = flavors
        self._hf_args = hf_args

    def __getitem__(self, flavor: str) -> TransformerArgs:
        if flavor == "hf":
            return self._hf_args()
        return copy.deepcopy(self._flavors[flavor])

    def __iter__(self) -> Iterator[str]:
        return iter([*self._flavors, "hf"])

    def __len__(self) -> int:
        return len(self._flavors) + 1


def _train_spec(family: str) -> TrainSpec:
    return TrainSpec(
        model_cls=Transformer,
        model_args=FlavorCopies(FLAVORS[family], HF_ARGS.get(family, HFConfigArgs)),
        parallelize_fn=parallelize,
        pipelining_fn=pipeline,
        build_optimizers_fn=build_optimizers,
        build_lr_schedulers_fn=build_lr_schedulers,
        build_dataloader_fn=build_dataloader,
        build_tokenizer_fn=build_tokenizer,
        build_loss_fn=build_loss,
        build_metrics_processor_fn=build_metrics_processor,
        state_dict_adapter=ADAPTERS[family],
    )


def register_train_specs() -> None:
    for family in FLAVORS:
        # ours take precedence over torchtitan's own family of the same name (deepseek_v3):
        # get_train_spec reads registered specs first
        try:
            register_train_spec(family, _train_spec(family))
        except ValueError:
            pass  # registered by an earlier call in this process
