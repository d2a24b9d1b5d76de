"""The `hf` flavor: model args read from a Hugging Face config.json when the job config is applied."""

import dataclasses
from dataclasses import dataclass

from titan_fold.common.config import ConfigError
from titan_fold.models.args import TransformerArgs
from titan_fold.models.deepseek_v3 import DeepSeekV3Args
from titan_fold.models.gpt_oss import GptOssArgs
from titan_fold.models.hf_adapter import args_from_hf_config
from titan_fold.models.qwen3_5 import Qwen35Args


@dataclass
class HFConfigArgs(TransformerArgs):
    """The `hf` flavor: every shape comes from the Hugging Face config named by `[model] hf_config`
    (a config.json, or the HF folder holding one), read when the job config is applied. Unset,
    it is the folder the run starts from with `checkpoint.initial_load_in_hf`."""

    def update_from_config(self, job_config, **kwargs) -> None:
        path = getattr(job_config.model, "hf_config", "")
        ckpt = job_config.checkpoint
        if not path and ckpt.initial_load_in_hf and ckpt.initial_load_path:
            path = ckpt.initial_load_path
        if not path:
            raise ConfigError(
                "model.flavor = 'hf' needs model.hf_config: a config.json or the Hugging Face folder holding it"
            )
        _, loaded = args_from_hf_config(path, job_config.model.name)
        for f in dataclasses.fields(loaded):
            setattr(self, f.name, getattr(loaded, f.name))
        super().update_from_config(job_config, **kwargs)


@dataclass
class DeepSeekV3HFConfigArgs(HFConfigArgs, DeepSeekV3Args):
    """The deepseek_v3 `hf` flavor: every size from `[model] hf_config`, the MLA model's methods."""


@dataclass
class Qwen35HFConfigArgs(HFConfigArgs, Qwen35Args):
    """The qwen3_5_moe / qwen3_next `hf` flavor: every size from `[model] hf_config`, the hybrid
    model's methods (linear attention, zero-centered norms, its FLOP count)."""


@dataclass
class GptOssHFConfigArgs(HFConfigArgs, GptOssArgs):
    """The gpt_oss `hf` flavor: every size from `[model] hf_config`, GPT-OSS's YaRN tables."""


# the `hf` flavor's args class of each family whose model args are not plain TransformerArgs
HF_ARGS = {
    "deepseek_v3": DeepSeekV3HFConfigArgs,
    "gpt_oss": GptOssHFConfigArgs,
    "qwen3_5_moe": Qwen35HFConfigArgs,
    "qwen3_next": Qwen35HFConfigArgs,
}
