from pathlib import Path

import pytest

from titan_tpu.config import build_config, parse_overrides
from titan_tpu.run.setup import prepare_run

CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("*.toml"))


def test_defaults_then_toml_then_overrides(tmp_path):
    recipe = tmp_path / "r.toml"
    recipe.write_text('[training]\nsteps = 7\nseq_len = 64\n[optimizer]\nlr = 1e-3\n[lr_scheduler]\nwarmup_steps = 2\n')
    cfg = build_config(recipe, ["--training.steps", "9", "--optimizer.lr=3e-4", "--output_dir", "x",
                                "--metrics.tensorboard", "false", "--model.flavor", "debug"])
    assert cfg.training.steps == 9 and cfg.training.seq_len == 64
    assert cfg.optimizer.lr == 3e-4 and cfg.metrics.tensorboard is False
    assert cfg.run_dir == Path("x")
    assert build_config(None, ["--job.name", "abc"]).run_dir == Path("outputs/abc")


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_every_recipe_validates(path, monkeypatch, tmp_path):
    if 'backend = "tpu"' in path.read_text():
        # A graph-mode TPU recipe validates where TorchTPU is installed (a TPU VM); say it is.
        from titan_tpu import device

        monkeypatch.setattr(device, "_tpu_installed", lambda: True)
    overrides = []
    if 'hf_config = "path/to/' in path.read_text():
        # A recipe for the user's own HF model directory (chat_sft_hf): validate it with a small one.
        from transformers import LlamaConfig

        LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    max_position_embeddings=4096).save_pretrained(tmp_path)
        overrides = ["--model.hf_config", str(tmp_path)]
    if 'hf_config = "outputs/shapes_demo/' in path.read_text():
        # The vision-language learning check reads the directory its generator writes: write it here.
        from titan_tpu.tools.shapes_demo import DEFAULT_DIR, write_model_dir

        monkeypatch.chdir(tmp_path)
        write_model_dir(DEFAULT_DIR / "model")
    cfg = prepare_run(build_config(path, overrides)).cfg
    assert cfg.job.name == path.stem


@pytest.mark.parametrize("overrides, message", [
    (["--training.stepz", "3"], "unknown config key 'training.stepz'; valid keys in [training]: steps"),
    (["--trainin.steps", "3"], "section one of job, model, training"),
    (["--training.steps", "3.5"], "training.steps = '3.5' has the wrong type; expected int"),
    (["--metrics.tensorboard", "maybe"], "expected bool"),
    (["--training.device", "gpu"], "use one of auto, cpu, cuda, tpu"),
    (["--model.name", "gpt5"], "use one of llama3, qwen3"),
    (["--model.flavor", "13B"], "13B"),
    (["--training.steps", "0"], "training.steps = 0 must be >= 1"),
    (["--lr_scheduler.warmup_steps", "-1"], "lr_scheduler.warmup_steps must be >= 0"),
    (["--lr_scheduler.decay_ratio", "1.5"], "lr_scheduler.decay_ratio must be in [0, 1]"),
    (["--training.seq_len", "100000"], "exceeds the max_seq_len"),
    (["--training.steps"], "--training.steps needs a value"),
    (["steps=3"], "overrides look like --section.key VALUE"),
    (["--model.moe_load_balance", "expert_bias"], "model.moe_load_balance applies to mixture-of-experts models"),
    (["--model.name", "qwen3_moe", "--model.flavor", "8B"], "unknown flavor '8B' for model 'qwen3_moe'"),
    (["--parallelism.ep", "2"], "parallelism.ep = 2 spreads MoE experts; llama3/debug has none"),
    (["--model.name", "qwen3_moe", "--parallelism.ep", "3"], "parallelism.ep = 3 must divide the 8 experts"),
    (["--parallelism.ep", "0"], "parallelism.ep = 0 must be >= 1"),
    (["--parallelism.ep_dispatch", "ring"],
     "parallelism.ep_dispatch = 'ring' is not a valid choice; use one of all_gather, all_to_all"),
    (["--kernels.attention", "fast"], "kernels.attention = 'fast' is not a known implementation; use auto or one of"),
    (["--kernels.loss", "fused"], "kernels.loss = 'fused' is not a known implementation"),
    (["--kernels.chunk_attention", "ring"], "kernels.chunk_attention = 'ring' is not a known implementation"),
    (["--kernels.loss_chunk_tokens", "-5"], "kernels.loss_chunk_tokens = -5 must be >= 0"),
    (["--kernels.loss", "tokamax", "--data.format", "chat"], "kernels.loss = tokamax cannot skip the untrained tokens"),
    (["--training.global_batch_tokens", "1000", "--training.batch_size", "2", "--training.seq_len", "64",
      "--parallelism.dp_shard", "1"],
     "training.global_batch_tokens = 1000 is not a multiple of batch_size x seq_len x data-parallel ranks = "
     "2 x 64 x 1 = 128"),
    (["--training.global_batch_tokens", "256", "--training.grad_accum_steps", "2"], "remove one of them"),
    (["--fault_tolerance.enabled", "true", "--fault_tolerance.replica_id", "2"],
     "fault_tolerance.replica_id = 2 must be in [0, fault_tolerance.replicas = 2)"),
    (["--fault_tolerance.enabled", "true", "--fault_tolerance.lighthouse", "29510"],
     "fault_tolerance.lighthouse = '29510' must be host:port"),
    (["--fault_tolerance.enabled", "true", "--training.mode", "graph"], "set --training.mode eager"),
    (["--fault_tolerance.enabled", "true", "--parallelism.dp_replicate", "2"], "set parallelism.dp_replicate 1"),
    (["--compile.backend", "jax", "--training.mode", "graph", "--training.device", "cuda"],
     "compile.backend jax runs on a TPU or this CPU; training.device is cuda"),
    (["--compile.backend", "jax", "--training.mode", "graph", "--compile.split", "collectives"],
     "compile.split = collectives: compile.backend jax hands XLA the whole step as one program"),
    (["--fault_tolerance.enabled", "true", "--training.global_batch_tokens", "512", "--training.batch_size", "2",
      "--training.seq_len", "64", "--parallelism.dp_shard", "1", "--fault_tolerance.replicas", "3"],
     "training.global_batch_tokens = 512 is not a multiple of batch_size x seq_len x data-parallel ranks = "
     "2 x 64 x 3 = 384"),
])
def test_bad_config_is_one_clear_error(overrides, message):
    """Read (config.py: keys, types, each section's own checks) and set up (run/setup.py: across
    sections, asking the model spec, the schedule, the trackers): one line either way."""
    with pytest.raises(ValueError) as err:
        prepare_run(build_config(None, overrides))
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_bad_toml(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        build_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[training\nsteps=1")
    with pytest.raises(ValueError, match="not valid TOML"):
        build_config(bad)
    wrong = tmp_path / "wrong.toml"
    wrong.write_text('[training]\nsteps = "many"\n')
    with pytest.raises(ValueError, match="training.steps = 'many' has the wrong type"):
        build_config(wrong)


def test_parse_overrides():
    assert parse_overrides(["--a.b", "1", "--c.d=x=y"]) == [("a.b", "1"), ("c.d", "x=y")]


def test_trackers_list_from_command_line_and_toml(tmp_path):
    cfg = build_config(None, ["--metrics.trackers", "tensorboard, wandb", "--profiling.enabled", "true"])
    assert cfg.metrics.trackers == ["tensorboard", "wandb"] and cfg.profiling.enabled
    recipe = tmp_path / "r.toml"
    recipe.write_text('[metrics]\ntrackers = ["wandb"]\n')
    assert build_config(recipe).metrics.trackers == ["wandb"]
    assert build_config(None).metrics.trackers == ["tensorboard"]
    with pytest.raises(ValueError, match="metrics.trackers: unknown tracker 'mlflow'; use some of tensorboard, wandb"):
        prepare_run(build_config(None, ["--metrics.trackers", "mlflow"]))
    recipe.write_text("[metrics]\ntrackers = 3\n")
    with pytest.raises(ValueError, match="expected a list of strings"):
        build_config(recipe)
    with pytest.raises(ValueError, match="profiling.start_step = 0"):
        build_config(None, ["--profiling.start_step", "0"])


def test_global_batch_tokens_sets_accumulation_from_the_data_parallel_ranks():
    from titan_tpu.config import grad_accum_from_tokens

    cfg = build_config(None, ["--training.global_batch_tokens", "1024", "--training.batch_size", "2",
                              "--training.seq_len", "64"])
    assert grad_accum_from_tokens(cfg.training, 1) == 8 and grad_accum_from_tokens(cfg.training, 4) == 2
    with pytest.raises(ValueError, match=r"2 x 64 x 16 = 2048 \(the nearest world sizes that keep it: 8 ranks\)"):
        grad_accum_from_tokens(cfg.training, 16)
    assert grad_accum_from_tokens(build_config(None, ["--training.grad_accum_steps", "3"]).training, 8) == 3
    # A restart on 3 ranks (of 2 tensor-parallel ranks each) cannot keep 8 sequences: 2 or 4 data-parallel ranks can.
    with pytest.raises(ValueError, match=r"the nearest world sizes that keep it: 4 ranks or 8 ranks"):
        grad_accum_from_tokens(cfg.training, 3, ranks_per_dp=2)
