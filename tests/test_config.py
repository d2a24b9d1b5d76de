"""Job config: TOML + CLI through torchtitan's ConfigManager, titan_fold's keys and rules."""

import pytest

from titan_fold.common.config import ConfigError, parse_args


def write(tmp_path, text: str) -> str:
    path = tmp_path / "job.toml"
    path.write_text(text)
    return str(path)


def test_toml_and_cli_override(tmp_path):
    path = write(
        tmp_path,
        '[moe]\ncapacity_factor = 1.25\nscore_func = "sigmoid"\n'
        "[parallelism]\nexpert_parallel_degree = 4\nexpert_tensor_parallel_degree = 2\n",
    )
    config = parse_args(
        ["--job.config_file", path, "--moe.top_k", "3", "--parallelism.expert_data_parallel_degree", "2"]
    )
    assert config.moe.capacity_factor == 1.25
    assert config.moe.score_func == "sigmoid"
    assert config.moe.top_k == 3
    assert config.moe.drop_policy is None  # unset keeps the flavor's value
    assert config.parallelism.expert_parallel_degree == 4
    assert config.parallelism.expert_tensor_parallel_degree == 2
    assert config.parallelism.expert_data_parallel_degree == 2


def test_defaults_without_file():
    config = parse_args([])
    assert config.parallelism.expert_data_parallel_degree == -1
    assert config.moe.capacity_factor is None


def test_bare_name_found_in_packaged_configs():
    config = parse_args(["--job.config_file", "debug_moe.toml"])
    assert config.model.name == "qwen2_moe" and config.model.flavor == "debug"


def test_missing_file_names_it():
    with pytest.raises(ConfigError, match="nothere.toml' does not exist.*debug_moe.toml"):
        parse_args(["--job.config_file", "nothere.toml"])


@pytest.mark.parametrize(
    "text, message",
    [
        ("[moe]\nfoo = 1\n", "unknown key 'moe.foo'"),
        ("[parallelism]\nexpert_parallel = 2\n", "unknown key 'parallelism.expert_parallel'"),
        ("[nonsense]\na = 1\n", "unknown key 'nonsense'"),
        ('[moe]\nscore_func = "tanh"\n', r"moe.score_func = 'tanh': must be one of \['softmax', 'sigmoid'\]"),
        ('[moe]\nload_balance = "aux"\n', "moe.load_balance = 'aux'"),
        ('[moe]\ndrop_scope = "sequence"\n', "moe.drop_scope"),
        ("[moe]\ncapacity_factor = 0.0\n", "moe.capacity_factor = 0.0: must be > 0"),
        ('[moe]\ntoken_drop = "drop_and_pad"\n', "moe.token_drop = 'drop_and_pad' needs moe.capacity_factor"),
        # the moved key, read as token_drop = "drop_and_pad"
        ("[moe]\npad_to_capacity = true\n", "moe.token_drop = 'drop_and_pad' needs moe.capacity_factor"),
        (
            '[moe]\ncapacity_factor = 1.0\ntoken_drop = "dropless"\n',
            "moe.capacity_factor = 1.0 with moe.token_drop = 'dropless'",
        ),
        (
            '[moe]\ncapacity_factor = 1.0\npad_to_capacity = true\ntoken_drop = "drop"\n',
            "moe.pad_to_capacity = true with moe.token_drop = 'drop': the old key moved to moe.token_drop",
        ),
        ('[moe]\ndrop_policy = "position"\n', "moe.drop_policy = 'position' needs moe.capacity_factor"),
        ("[moe]\ntop_k = 0\n", "moe.top_k = 0: must be >= 1"),
        ("[moe]\naux_loss_coeff = -0.1\n", "moe.aux_loss_coeff = -0.1: must be >= 0"),
        ('[moe]\nload_balance = "aux_free"\naux_loss_coeff = 0.01\n', "has no effect"),
        ("[parallelism]\nexpert_parallel_degree = 0\n", "parallelism.expert_parallel_degree = 0: must be >= 1"),
        ("[parallelism]\nexpert_data_parallel_degree = 0\n", "parallelism.expert_data_parallel_degree = 0"),
        (
            '[activation_checkpoint]\nmode = "full"\nmoe_layer_recompute = true\n',
            "activation_checkpoint.moe_layer_recompute = true with activation_checkpoint.mode = 'full': the old "
            "key moved to activation_checkpoint.mode",
        ),
        ("[moe\n", "not valid TOML"),
        (
            '[moe]\ncapacity_factor = 1.0\nexchange = "static"\n',
            "moe.exchange = 'static' with moe.capacity_factor = 1.0: it is for dropless routing",
        ),
        (
            "[moe]\ncapacity_factor = 1.0\nstatic_ep_exchange = true\n",  # the moved key, read as exchange = "static"
            "moe.exchange = 'static' with moe.capacity_factor = 1.0: it is for dropless routing",
        ),
        (
            '[moe]\nexchange = "exact"\nstatic_ep_exchange = true\n',
            "moe.static_ep_exchange = true with moe.exchange = 'exact'",
        ),
        (
            '[moe]\nexchange = "device"\ncapacity_factor = 1.0\n',
            "moe.exchange = 'device' with moe.capacity_factor = 1.0",
        ),
        (
            '[moe]\nexchange = "device"\n[parallelism]\nexpert_tensor_parallel_degree = 2\n',
            "moe.exchange = 'device' with parallelism.expert_tensor_parallel_degree = 2 and expert_parallel_degree = 1",
        ),
        (
            '[moe]\nexchange = "device"\noverlap_ep_comm = true\n',  # the moved key, read as ep_overlap = "batch"
            "moe.ep_overlap = 'batch' with moe.exchange = 'device'",
        ),
        (
            '[moe]\nexpert_kernels = "torch"\ngrouped_gemm = "quack"\n',
            "moe.grouped_gemm = 'quack' with moe.expert_kernels = 'torch': the old key moved to moe.expert_kernels",
        ),
        (
            '[moe]\ngrouped_gemm = "quack"\nexpert_fp8 = true\n',
            "moe.expert_fp8 = true with moe.expert_kernels = 'quack': the old key moved to moe.expert_kernels",
        ),
        (
            '[moe]\nexchange = "device"\n[compile]\nenable = true\ncudagraphs = true\n',
            "moe.exchange = 'device' with compile.cudagraphs = true",
        ),
        ('[moe]\nexchange = "fast"\n', "moe.exchange"),
        (
            '[parallelism]\nexpert_parallel_comm_backend = "deepep"\n',
            "parallelism.expert_parallel_comm_backend = 'deepep': not used by titan_fold",
        ),
        (
            "[parallelism]\nenable_async_tensor_parallel = true\n",
            "parallelism.enable_async_tensor_parallel = True: not used by titan_fold",
        ),
        (
            '[parallelism]\ncontext_parallel_rotate_method = "alltoall"\n',
            "parallelism.context_parallel_rotate_method = 'alltoall': not used by titan_fold",
        ),
        (
            "[compile]\nenable = true\ncudagraphs = true\n[parallelism]\nexpert_parallel_degree = 2\n",
            "compile.cudagraphs = true with dropless routing .*; set moe.exchange = 'static'",
        ),
        ("[moe]\nstash_rows = 100\n", "moe.stash_rows = 100 with moe.exchange = 'auto'"),
        (
            "[moe]\nstatic_ep_exchange = true\nstash_rows = 100\n",  # activation checkpointing: selective
            "moe.stash_rows = 100 with activation_checkpoint.mode = 'selective'",
        ),
        (
            '[moe]\nstatic_ep_exchange = true\nstash_rows = 100\n[activation_checkpoint]\nmode = "none"\n'
            "moe_layer_recompute = true\n",
            "moe.stash_rows = 100 with activation_checkpoint.mode = 'moe_layers'",
        ),
        (
            '[moe]\nstatic_ep_exchange = true\nstash_rows = 100\n[activation_checkpoint]\nmode = "none"\n'
            "[compile]\nenable = true\ncudagraphs = true\n",
            "moe.stash_rows = 100 with compile.cudagraphs = true",
        ),
    ],
)
def test_bad_config_names_key_and_rule(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message):
        parse_args(["--job.config_file", write(tmp_path, text)])


@pytest.mark.parametrize(
    "args",
    [
        [],  # one EP rank: the dropless layer has no host sync
        ["--parallelism.expert_parallel_degree", "2", "--moe.exchange", "static"],
        ["--parallelism.expert_parallel_degree", "2", "--moe.static_ep_exchange"],  # the moved key
        [
            "--parallelism.expert_parallel_degree",
            "2",
            "--moe.capacity_factor",
            "1.0",
            "--moe.token_drop",
            "drop_and_pad",
        ],
        ["--parallelism.expert_parallel_degree", "2", "--moe.capacity_factor", "1.0", "--moe.pad_to_capacity", "True"],
    ],
)
def test_cudagraphs_with_static_shapes_accepted(args):
    config = parse_args(["--compile.enable", "--compile.cudagraphs", *args])
    assert config.compile.cudagraphs


def test_moved_static_key_reads_as_exchange(capsys):
    """The old `moe.static_ep_exchange = true` still works, as `moe.exchange = "static"`, with a
    one-line notice; the model's MoEArgs get the new key."""
    from titan_fold.trainer.preflight import model_args_from_config

    config = parse_args(
        ["--job.config_file", "debug_moe.toml", "--moe.static_ep_exchange", "--parallelism.expert_parallel_degree", "2"]
    )
    assert config.moe.exchange == "static" and not config.moe.static_ep_exchange
    notice = [line for line in capsys.readouterr().err.splitlines() if line.startswith("notice:")]
    assert notice == ['notice: moe.static_ep_exchange moved to moe.exchange; read as moe.exchange = "static"'], notice
    _, args = model_args_from_config(config)
    assert args.moe.exchange == "static"


@pytest.mark.parametrize(
    "args,token_drop,moe_args,notice",
    [
        pytest.param([], "dropless", (None, "dropless"), [], id="unset-dropless"),
        pytest.param(["--moe.capacity_factor", "1.5"], "drop", (1.5, "drop"), [], id="capacity-drops"),
        pytest.param(
            ["--moe.capacity_factor", "1.5", "--moe.token_drop", "drop_and_pad"],
            "drop_and_pad",
            (1.5, "drop_and_pad"),
            [],
            id="drop-and-pad",
        ),
        pytest.param(
            ["--moe.capacity_factor", "1.5", "--moe.pad_to_capacity", "True"],
            "drop_and_pad",
            (1.5, "drop_and_pad"),
            ['notice: moe.pad_to_capacity moved to moe.token_drop; read as moe.token_drop = "drop_and_pad"'],
            id="moved-pad-key",
        ),
    ],
)
def test_token_drop_reaches_the_model(capsys, args, token_drop, moe_args, notice):
    """moe.token_drop is one choice; unset, capacity_factor decides; the old pad_to_capacity = true
    reads as "drop_and_pad" with a one-line notice. The model's MoEArgs get the capacity and the choice."""
    from titan_fold.trainer.preflight import model_args_from_config

    config = parse_args(["--job.config_file", "debug_moe.toml", *args])
    assert config.moe.token_drop == token_drop and not config.moe.pad_to_capacity
    assert [line for line in capsys.readouterr().err.splitlines() if line.startswith("notice:")] == notice
    _, model_args = model_args_from_config(config)
    assert (model_args.moe.capacity_factor, model_args.moe.token_drop) == moe_args


@pytest.mark.parametrize(
    "args,kernels,ep_overlap",
    [
        pytest.param(["--moe.grouped_gemm", "quack"], "quack", "off", id="grouped-gemm"),
        pytest.param(["--moe.expert_fp8"], "fp8", "off", id="expert-fp8"),
        pytest.param(["--moe.grouped_gemm", "torch", "--moe.expert_fp8"], "fp8", "off", id="fp8-on-torch"),
        pytest.param(["--moe.delay_wgrad_compute"], "auto", "wgrad", id="delay-wgrad"),
        pytest.param(["--moe.overlap_ep_comm"], "auto", "batch", id="overlap"),
        pytest.param(["--moe.overlap_ep_comm", "--moe.delay_wgrad_compute"], "auto", "batch_wgrad", id="both"),
    ],
)
def test_moved_speed_keys_read_as_choices(capsys, args, kernels, ep_overlap):
    """The old flags still work as moe.expert_kernels and moe.ep_overlap, each with a one-line notice
    naming its new key; every combination they allowed is one value."""
    base = ["--job.config_file", "debug_moe.toml", "--parallelism.expert_parallel_degree", "2"]
    config = parse_args([*base, "--training.mixed_precision_param", "bfloat16", *args])
    moe = config.moe
    assert (moe.expert_kernels, moe.ep_overlap) == (kernels, ep_overlap)
    assert (moe.grouped_gemm, moe.expert_fp8, moe.delay_wgrad_compute, moe.overlap_ep_comm) == (
        None,
        False,
        False,
        False,
    )
    notice = [line for line in capsys.readouterr().err.splitlines() if line.startswith("notice:")]
    new = "moe.expert_kernels" if kernels != "auto" else "moe.ep_overlap"
    moved = {f"notice: {a.removeprefix('--')} moved to {new}" for a in args if a.startswith("--moe.")}
    assert {line.partition(";")[0] for line in notice} == moved and len(notice) == len(moved), notice
    assert notice[-1].endswith(f'read as {new} = "{kernels if kernels != "auto" else ep_overlap}"'), notice


def test_moved_recompute_key_reads_as_mode(capsys):
    """The old `moe_layer_recompute = true` (with mode = "none") is `mode = "moe_layers"`, with a notice."""
    config = parse_args(
        ["--job.config_file", "debug_moe.toml", "--activation_checkpoint.mode", "none"]
        + ["--activation_checkpoint.moe_layer_recompute"]
    )
    ac = config.activation_checkpoint
    assert ac.mode == "moe_layers" and not ac.moe_layer_recompute
    notice = [line for line in capsys.readouterr().err.splitlines() if line.startswith("notice:")]
    assert notice == [
        "notice: activation_checkpoint.moe_layer_recompute moved to activation_checkpoint.mode; "
        'read as activation_checkpoint.mode = "moe_layers"'
    ]


@pytest.mark.parametrize("args", [[], ["--compile.enable"]])
def test_stash_accepted_without_recompute(args):
    config = parse_args(
        [
            "--moe.exchange",
            "static",
            "--moe.stash_rows",
            "4096",
            "--activation_checkpoint.mode",
            "none",
            "--parallelism.expert_parallel_degree",
            "2",
            *args,
        ]
    )
    assert config.moe.stash_rows == 4096


@pytest.mark.parametrize(
    "name, world", [("qwen2.toml", 64), ("mixtral_8x22b.toml", 128), ("mixtral_8x22b_g8t8.toml", 128)]
)
def test_packaged_configs_fit_their_world(name, world):
    """The real-size configs' degrees, pipeline schedule and micro-batches pass the trainer's
    checks at the world size they are written for (their tokenizers are not in the repo)."""
    from titan_fold.trainer.preflight import check_layout

    layout = check_layout(parse_args(["--job.config_file", name]), world)
    assert layout.world_size == world and layout.ep > 1


def _described(cls) -> tuple[dict[str, str], list[str]]:
    """The field docstrings written in cls's own body (name -> text), and its comments."""
    import ast
    import inspect
    import io
    import textwrap
    import tokenize

    source = textwrap.dedent(inspect.getsource(cls))
    body = next(node for node in ast.parse(source).body if isinstance(node, ast.ClassDef)).body
    docs = {
        field.target.id: text.value.value
        for field, text in zip(body, body[1:], strict=False)
        if isinstance(field, ast.AnnAssign) and isinstance(field.target, ast.Name)
        if isinstance(text, ast.Expr) and isinstance(text.value, ast.Constant) and isinstance(text.value.value, str)
    }
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    return docs, [t.string for t in tokens if t.type == tokenize.COMMENT]


def test_each_moe_key_is_described_once():
    """[moe] and the layer's MoEArgs are one description: every field of the section and of MoEArgs
    has one docstring, on one class, and no comment beside it; the section's keys are MoEArgs'
    (the moved keys aside) with its types, unset (None) where a flavor may set them and with the
    layer's defaults for the job's keys (JOB_KEYS)."""
    import dataclasses

    from titan_fold.common.moe_config import JOB_KEYS, MoE, MovedMoEKeys
    from titan_fold.common.rules import MOVED
    from titan_fold.moe import MoEArgs

    classes = list(dict.fromkeys(c for c in (*MoE.__mro__, *MoEArgs.__mro__) if c is not object))
    described = {cls: _described(cls) for cls in classes}
    assert {cls.__name__: comments for cls, (_, comments) in described.items() if comments} == {}
    names = dict.fromkeys(f.name for cls in (MoE, MoEArgs) for f in dataclasses.fields(cls))
    where = {name: [cls.__name__ for cls in classes if name in described[cls][0]] for name in names}
    assert {name: on for name, on in where.items() if len(on) != 1} == {}

    moved = {f.name for f in dataclasses.fields(MovedMoEKeys)}
    assert moved == {m.old for m in MOVED if m.section == "moe"}
    layer = {f.name: f for f in dataclasses.fields(MoEArgs)}
    assert set(JOB_KEYS) <= set(layer)
    for key in dataclasses.fields(MoE):
        if key.name in moved:
            continue
        field = layer[key.name]
        want = (field.type, field.default) if key.name in JOB_KEYS else (field.type | None, None)
        assert (key.type, key.default) == want, key.name
