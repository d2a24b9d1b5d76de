"""Each rule of common/rules.py's table is the first one a config breaking it meets, and the
default config breaks none (the messages themselves: tests/test_config.py)."""

import pytest

from titan_fold.common.config import JobConfig
from titan_fold.common.rules import broken_rule, move_keys, rule_list

EP2 = {"parallelism.expert_parallel_degree": 2}
OVERLAP = {"moe.ep_overlap": "batch", **EP2}

# (the keys set on the default config, the start of the broken rule's line)
CASES = [
    ({"moe.token_drop": "drop"}, "moe.token_drop = 'drop' needs moe.capacity_factor"),
    ({"moe.drop_policy": "probs"}, "moe.drop_policy = 'probs' needs"),
    ({"moe.drop_scope": "full_sequence"}, "moe.drop_scope = 'full_sequence' needs"),
    ({"moe.capacity_factor": 1.0, "moe.token_drop": "dropless"}, "moe.capacity_factor = 1.0 with"),
    ({"moe.load_balance": "none", "moe.aux_loss_coeff": 0.1}, "moe.aux_loss_coeff = 0.1 has no effect"),
    ({"model.hf_config": "config.json"}, "model.hf_config is read only"),
    ({"optimizer.name": "Muon", "optimizer.master_weights": True}, "optimizer.name = 'Muon' with optimizer.master"),
    (
        {"optimizer.name": "Muon", "optimizer.early_step_in_backward": True},
        "optimizer.name = 'Muon' with optimizer.early",
    ),
    ({"optimizer.master_weights": True}, "optimizer.master_weights = true with training.dtype = 'float32'"),
    ({"compile.cudagraphs": True}, "compile.cudagraphs = true needs compile.enable"),
    ({"moe.exchange": "static", "moe.capacity_factor": 1.0}, "moe.exchange = 'static' with moe.capacity_factor"),
    ({"moe.exchange": "device", "parallelism.expert_tensor_parallel_degree": 2}, "moe.exchange = 'device' with par"),
    ({"moe.exchange": "device", "moe.capacity_factor": 1.0}, "moe.exchange = 'device' with moe.capacity_factor"),
    (
        {"moe.exchange": "device", "compile.enable": True, "compile.cudagraphs": True},
        "moe.exchange = 'device' with compile.cudagraphs = true",
    ),
    ({"moe.exchange": "device", "moe.ep_overlap": "wgrad"}, "moe.ep_overlap = 'wgrad' with moe.exchange"),
    ({"moe.hot_expert_replicas": 2, "moe.exchange": "static"}, "moe.hot_expert_replicas = 2 with moe.exchange ="),
    ({"moe.hot_expert_replicas": 2, "moe.capacity_factor": 1.0}, "moe.hot_expert_replicas = 2 with moe.capacity"),
    ({"moe.hot_expert_replicas": 2, **OVERLAP}, "moe.hot_expert_replicas = 2 with moe.ep_overlap = 'batch'"),
    ({"moe.hot_expert_replicas": 2, "moe.expert_kernels": "fp8"}, "moe.hot_expert_replicas = 2 with moe.expert_kern"),
    (
        {"moe.hot_expert_replicas": 2, "compile.enable": True, "compile.cudagraphs": True},
        "moe.hot_expert_replicas = 2 with compile.cudagraphs",
    ),
    ({"moe.hot_expert_replicas": 2}, "moe.hot_expert_replicas = 2 with parallelism.expert_parallel_degree = 1"),
    ({"moe.stash_rows": 100}, "moe.stash_rows = 100 with moe.exchange = 'auto'"),
    (
        {"moe.stash_rows": 100, "moe.exchange": "static"},
        "moe.stash_rows = 100 with activation_checkpoint.mode = 'selective'",
    ),
    (
        {
            "moe.stash_rows": 100,
            "moe.exchange": "static",
            "activation_checkpoint.mode": "none",
            "compile.enable": True,
            "compile.cudagraphs": True,
        },
        "moe.stash_rows = 100 with compile.cudagraphs",
    ),
    ({"compile.enable": True, "compile.cudagraphs": True, **EP2}, "compile.cudagraphs = true with dropless routing"),
    ({"moe.expert_kernels": "fp8", "training.mixed_precision_param": "float32"}, "moe.expert_kernels = 'fp8' with"),
    (
        {"optimizer.master_weights": True, "optimizer.early_step_in_backward": True, "training.dtype": "bfloat16"},
        "optimizer.master_weights = true with optimizer.early_step_in_backward = true",
    ),
    ({"training.dataset_format": "chat", "mtp.num_layers": 1}, "training.document_masking with mtp.num_layers = 1"),
    (
        {"training.document_masking": True, "moe.ep_overlap": "batch_wgrad"},
        "training.document_masking with moe.ep_overlap = 'batch_wgrad'",
    ),
    (
        {
            "training.dataset_format": "chat",
            "parallelism.context_parallel_degree": 2,
            "moe.token_drop": "drop",
            "moe.capacity_factor": 1.0,
            "moe.drop_scope": "full_sequence",
        },
        "moe.drop_scope = 'full_sequence' with training.document_masking under parallelism.context_parallel_degree = 2",
    ),
    ({"moe.ep_overlap": "wgrad"}, "moe.ep_overlap = 'wgrad' with parallelism.expert_parallel_degree = 1"),
    ({"moe.ep_overlap": "wgrad", "compile.enable": True, **EP2}, "moe.ep_overlap = 'wgrad' with compile"),
    (
        {"parallelism.pipeline_parallel_degree": 2, "parallelism.pipeline_parallel_schedule": "GPipe", **OVERLAP},
        "moe.ep_overlap = 'batch' with parallelism.pipeline_parallel_schedule = 'GPipe'",
    ),
    ({"mtp.num_layers": 1, **OVERLAP}, "moe.ep_overlap = 'batch' with mtp.num_layers = 1"),
    (OVERLAP, "moe.ep_overlap = 'batch' with activation_checkpoint.mode = 'selective'"),
    ({"training.objective": "policy"}, "training.objective = 'policy' with training.dataset_format = 'text'"),
    ({"moe.routing_replay": "rollout"}, "moe.routing_replay = 'rollout' with training.dataset_format = 'text'"),
    (
        {"moe.routing_replay": "recorded", **OVERLAP, "activation_checkpoint.mode": "none"},
        "moe.ep_overlap = 'batch' with moe.routing_replay = 'recorded'",
    ),
    ({"checkpoint.initial_load_path": "seed"}, "checkpoint.initial_load_path = 'seed' needs checkpoint.enable"),
]


def config_with(keys: dict) -> JobConfig:
    config = JobConfig()
    for key, value in keys.items():
        *sections, name = key.split(".")
        owner = config
        for section in sections:
            owner = getattr(owner, section)
        setattr(owner, name, value)
    assert move_keys(config) is None
    return config


def first_broken(config: JobConfig) -> int | None:
    return next((i for i, rule in enumerate(rule_list()) if rule.broken(config)), None)


def test_default_config_breaks_no_rule():
    assert broken_rule(config_with({})) is None


@pytest.mark.parametrize("keys,line", CASES, ids=[line for _, line in CASES])
def test_rule_met_first(keys, line):
    assert broken_rule(config_with(keys)).startswith(line)


# combinations no rule refuses (each once was refused)
ACCEPTED = {
    "policy_with_mtp": {
        "training.objective": "policy",
        "training.dataset_format": "rollouts",
        "training.document_masking": False,
        "mtp.num_layers": 1,
    },
    "rollout_replay_with_mtp": {
        "moe.routing_replay": "rollout",
        "training.dataset_format": "rollouts",
        "training.document_masking": False,
        "mtp.num_layers": 2,
    },
    "recorded_replay_with_mtp": {"moe.routing_replay": "recorded", "mtp.num_layers": 1},
}


@pytest.mark.parametrize("keys", ACCEPTED.values(), ids=list(ACCEPTED))
def test_combination_accepted(keys):
    assert broken_rule(config_with(keys)) is None


def test_every_rule_has_its_case():
    met = sorted(first_broken(config_with(keys)) for keys, _ in CASES)
    assert met == list(range(len(rule_list())))
