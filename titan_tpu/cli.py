"""``titan-tpu`` command line: train, eval, convert, graph.

    titan-tpu train --config configs/llama3_debug.toml --training.steps 200 --optimizer.lr 3e-4
    titan-tpu eval --hf-dir DIR --token-file tokens.json     # or --text corpus/, or the model as for train
    titan-tpu eval --checkpoint outputs/run --tasks hellaswag,arc_easy   # lm-eval benchmarks (the eval extra)
    titan-tpu generate --checkpoint outputs/run --prompt "def main"   # or --hf-dir DIR, --prompts-file FILE.jsonl
    titan-tpu convert --checkpoint outputs/run/checkpoints --to-hf hf_out/
    titan-tpu convert --hf-dir hf_in/ --to-checkpoint ckpt_out/
    titan-tpu graph --config configs/llama3_debug.toml      # dump the captured step graph
    titan-tpu kernels [--device cpu|cuda|tpu]               # kernel implementations and auto's pick
    titan-tpu plan --config configs/qwen3_235b_a22b_tpu.toml [--hardware v5p-1024] [--json]
    titan-tpu plan --search --config configs/llama3_8b_tpu.toml [--hardware v5p-256] [--json]   # best knobs
    titan-tpu plan --calibrate                              # predicted vs measured on real CPU runs
    titan-tpu prepare-data --config configs/llama3_debug.toml --workers 2   # tokenize the sources once
    titan-tpu report outputs/run_a outputs/run_b [--out report.html] [--png DIR]   # plots in one HTML file
    titan-tpu verify MODEL [--tiny] [--hardware v5p-256] [--checks a,b] [--report DIR]   # docs/verify.md
    titan-tpu config [SECTION]                              # every config key: type, default, meaning
    titan-tpu compile --config configs/llama3_debug.toml --hardware v5p-8   # XLA's TPU verdict (.venv-tpu)
    titan-tpu launch train --config configs/qwen3_8b_graph_tpu.toml   # on every host (gcloud ... --worker=all)
    titan-tpu lighthouse --port 29510 --replicas 2          # then each replica group: train --fault_tolerance.*
    titan-tpu --help | --version

User mistakes end the process with one line on stderr and exit status 2, not a traceback; faults of
the run's environment (a checkpoint that could not be written, an output_dir another run holds:
titan_tpu/errors.py ``RunError``) with one line and exit status 1.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path


@contextlib.contextmanager
def _process_group_cleanup():
    """Leave torch.distributed as a torchrun-launched command found it, also after an error."""
    try:
        yield
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def train_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="titan-tpu train",
        description="Train a model. Any config field can be overridden as --section.key VALUE "
                    "(e.g. --training.steps 200 --optimizer.lr 3e-4 --output_dir DIR).",
        epilog="Every key, with its type, default and meaning: titan-tpu config [SECTION]. Rerunning the same "
               "command resumes from the newest checkpoint in the output directory.")
    parser.add_argument("--config", help="TOML recipe, e.g. configs/llama3_debug.toml")
    args, overrides = parser.parse_known_args(argv)
    if _setting(args.config, overrides, "compile", "backend") == "jax" and \
            _setting(args.config, overrides, "training", "mode") == "graph":
        # The JAX path: JAX's runtime takes the TPU chips, so torch-tpu (which `import torch` loads in
        # an environment that has it) must not; read before torch is imported, below.
        os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

    from titan_tpu.config import build_config
    from titan_tpu.loops import assemble
    from titan_tpu.train.goodput import mark_launch

    mark_launch()  # goodput counts this process's start-up from its start
    cfg = build_config(args.config, overrides)
    with _process_group_cleanup():
        assemble(cfg).train()  # the setup, the parts, the kind's loop over them
    return 0


def _setting(config: str | None, overrides: list[str], section: str, key: str) -> str | None:
    """A config key as the command line sets it (an override, else the recipe's section), read
    without importing torch; None where neither names it or the recipe cannot be read (build_config
    then says why)."""
    import tomllib

    flag = f"--{section}.{key}"
    for i, arg in enumerate(overrides):
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
        if arg == flag and i + 1 < len(overrides):
            return overrides[i + 1]
    try:
        return tomllib.loads(Path(config).read_text()).get(section, {}).get(key) if config else None
    except (OSError, tomllib.TOMLDecodeError):
        return None


def eval_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="titan-tpu eval",
        description="Mean next-token cross-entropy and perplexity (JSON) of any model train takes, over a token "
                    "file or a text corpus. The model as for train (--config, --model.name, --model.flavor, "
                    "--model.hf_config DIR_OR_TYPE, --model.hf_overrides); --hf-dir DIR is short for an HF "
                    "directory of any causal-LM type.")
    parser.add_argument("--config", help="TOML recipe whose model section names the model")
    parser.add_argument("--hf-dir", help="Hugging Face model directory (config.json, *.safetensors)")
    parser.add_argument("--checkpoint", help="weights: a training checkpoint (step, checkpoints/ or run directory) or "
                                             "an HF directory; default: the model directory's own, else a seeded init")
    parser.add_argument("--token-file", help="JSON list of lists of token ids")
    parser.add_argument("--text", help="text to evaluate on: a file, a directory of .txt/.md/.py or a .jsonl "
                                       "(tokenized with --data.tokenizer_path or the model's tokenizer.json)")
    parser.add_argument("--rows", help="image-text chat rows (.jsonl/.parquet, as training reads them) for a "
                                       "vision-language model: the loss on the assistant's tokens")
    parser.add_argument("--seq-len", type=int, default=512,
                        help="with --text: tokens per window; with --rows: tokens per row (512)")
    parser.add_argument("--max-tokens", type=int, default=65536, help="with --text: tokens evaluated at most (65536)")
    parser.add_argument("--device", default=None, choices=["auto", "cpu", "cuda", "tpu"])
    tasks = parser.add_argument_group("benchmarks (lm-evaluation-harness, the eval extra)")
    tasks.add_argument("--tasks", help="comma-separated lm-eval tasks (hellaswag,arc_easy): their scores instead of "
                                       "the loss; a table, and the results JSON beside the weights")
    tasks.add_argument("--num-fewshot", type=int, default=None, help="examples in each prompt (default: the task's)")
    tasks.add_argument("--limit", type=float, default=None,
                       help="documents per task at most (a number below 1: that fraction of each task)")
    tasks.add_argument("--batch-size", type=int, default=8, help="rows per forward (8; --rows too)")
    tasks.add_argument("--include-path", help="a folder of task YAMLs of one's own (e.g. local data_files)")
    tasks.add_argument("--apply-chat-template", action="store_true",
                       help="render prompts with the tokenizer's chat template (or --data.chat_template's)")
    tasks.add_argument("--system-instruction", help="a system message before each prompt (with the chat template)")
    tasks.add_argument("--output", help="the results JSON (default: beside the weights, DIR.lm_eval.json)")
    args, overrides = parser.parse_known_args(argv)

    if args.tasks:
        return _eval_tasks(args, overrides)

    from titan_tpu.evaluation.loss import run_eval
    from titan_tpu.evaluation.rows import run_eval_rows

    if args.rows and (args.token_file or args.text):
        raise ValueError("titan-tpu eval needs exactly one of --token-file, --text and --rows; drop the others")
    setup = _model_config(args, overrides)
    if args.rows:
        result = run_eval_rows(setup, checkpoint=args.checkpoint, rows=args.rows, seq_len=args.seq_len,
                               batch_size=args.batch_size)
    else:
        result = run_eval(setup, checkpoint=args.checkpoint, token_file=args.token_file, text=args.text,
                          seq_len=args.seq_len, max_tokens=args.max_tokens)
    print(json.dumps(result))
    return 0


def _eval_tasks(args: argparse.Namespace, overrides: list[str]) -> int:
    """`titan-tpu eval --tasks`: benchmark scores (evaluation/tasks.py) instead of the loss."""
    from titan_tpu.evaluation.tasks import TaskSettings, run_tasks
    from titan_tpu.extras import require_lm_eval

    if args.token_file or args.text or args.rows:
        raise ValueError("--tasks scores lm-eval tasks, not --token-file, --text or --rows; drop one of them")
    require_lm_eval()  # before the model loads
    if args.batch_size < 1:
        raise ValueError(f"--batch-size {args.batch_size} must be >= 1")
    settings = TaskSettings(tuple(task.strip() for task in args.tasks.split(",") if task.strip()),
                            num_fewshot=args.num_fewshot, limit=args.limit, batch_size=args.batch_size,
                            include_path=args.include_path, apply_chat_template=args.apply_chat_template,
                            system_instruction=args.system_instruction)
    run_tasks(_model_config(args, overrides), checkpoint=args.checkpoint, settings=settings, output=args.output)
    return 0


def _model_config(args: argparse.Namespace, overrides: list[str]):
    """The run setup of a command that runs a model as train builds it (eval, generate): --hf-dir DIR
    is short for an HF directory of any causal-LM type, whose own weights it names (args.checkpoint);
    --device sets training.device."""
    from titan_tpu.config import build_config
    from titan_tpu.run.setup import prepare_run

    if args.hf_dir:
        if not Path(args.hf_dir).is_dir():
            raise FileNotFoundError(f"--hf-dir {args.hf_dir} is not a directory; give a Hugging Face model directory")
        if args.checkpoint:
            raise ValueError("--hf-dir already names the weights; drop --checkpoint (or give the directory as it)")
        overrides = ["--model.name", "hf", "--model.hf_config", args.hf_dir] + overrides
        args.checkpoint = args.hf_dir  # its own weights; a config the native adapter reads runs natively
    if args.device:
        overrides += ["--training.device", args.device]
    # training.seq_len does not apply (sequences are as given, eval's windows are --seq-len): keep validation quiet.
    return prepare_run(build_config(args.config, ["--training.seq_len", "2"] + overrides))


def generate_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="titan-tpu generate",
        description="Continue prompts with a model: a training checkpoint (a LoRA run's adapters merged), a Hugging "
                    "Face directory (--hf-dir), or the model as for train (--config, --model.*). Greedy by default; "
                    "one prompt streams to the terminal (docs/generate.md).")
    parser.add_argument("--checkpoint", help="a training checkpoint (step, checkpoints/ or run directory) or an HF "
                                             "directory")
    parser.add_argument("--hf-dir", help="Hugging Face model directory (config.json, *.safetensors)")
    parser.add_argument("--config", help="TOML recipe whose model section names the model")
    parser.add_argument("--prompt", action="append", default=[], help="a prompt (text); repeat for a batch")
    parser.add_argument("--prompts-file", help="a .jsonl file: one {\"prompt\": TEXT}, {\"messages\": [...]} or "
                                               "{\"token_ids\": [...]} per line")
    parser.add_argument("--chat", action="store_true",
                        help="render each --prompt as a user message with the tokenizer's chat template")
    parser.add_argument("--image", action="append", default=[],
                        help="an image file for the one --prompt (a vision-language model); repeat for several, in "
                             "order; the prompt is then a user message with the images before its text")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="new tokens per prompt at most (64)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy; > 0: sampled")
    parser.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: all)")
    parser.add_argument("--top-p", type=float, default=1.0, help="sample within this probability mass (1: all)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampler (the same seed, the same text)")
    parser.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
    parser.add_argument("--tokenizer", help="tokenizer.json (or its directory); default: the one beside the weights")
    parser.add_argument("--compile", action="store_true",
                        help="compile the decode step once (Inductor on CPU and CUDA, TorchTPU on a TPU)")
    parser.add_argument("--json", action="store_true", help="one JSON object per prompt (prompt, completion, "
                                                            "tokens, finish)")
    parser.add_argument("--no-stream", action="store_true", help="print a single prompt's completion at the end")
    parser.add_argument("--device", default=None, choices=["auto", "cpu", "cuda", "tpu"])
    args, overrides = parser.parse_known_args(argv)

    from titan_tpu.generate.sampling import Sampling
    from titan_tpu.tools.generate_cmd import run_generate

    sampling = Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    cfg = _model_config(args, overrides).cfg
    run_generate(cfg, checkpoint=args.checkpoint, prompts=args.prompt, prompts_file=args.prompts_file, chat=args.chat,
                 tokenizer_path=args.tokenizer, max_new_tokens=args.max_new_tokens, sampling=sampling, seed=args.seed,
                 ignore_eos=args.ignore_eos, compile=args.compile, as_json=args.json, stream=not args.no_stream,
                 images=args.image)
    return 0


def convert_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="titan-tpu convert",
        description="Convert between a training checkpoint and a Hugging Face directory.")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", help="a step-XXXXXXXX checkpoint, or a checkpoints/ or run directory "
                                             "(its newest checkpoint is used)")
    source.add_argument("--hf-dir", help="Hugging Face model directory to import")
    parser.add_argument("--to-hf", help="output Hugging Face directory (with --checkpoint)")
    parser.add_argument("--to-checkpoint", help="output checkpoints directory (with --hf-dir)")
    parser.add_argument("--to-peft", help="output peft adapter directory of a LoRA run (with --checkpoint)")
    parser.add_argument("--base-model", help="with --to-peft: the adapters' base model as peft names it (an HF "
                                             "directory or Hub id; default: the HF directory the run started from)")
    parser.add_argument("--merge-lora", action="store_true",
                        help="with --to-hf: fold a LoRA run's adapters into the weights (a plain HF model)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"],
                        help="with --to-hf: the dtype of the exported weights (default bfloat16, as models are "
                             "served; float32 keeps the checkpoint's master weights exactly)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output")
    args = parser.parse_args(argv)

    from titan_tpu import convert

    if args.base_model and not args.to_peft:
        parser.error("--base-model names the base of a --to-peft export; leave it out")
    if args.checkpoint:
        if bool(args.to_hf) == bool(args.to_peft):
            parser.error("--checkpoint needs one of --to-hf OUT_DIR or --to-peft OUT_DIR")
        if args.to_peft:
            out = convert.checkpoint_to_peft(args.checkpoint, args.to_peft, overwrite=args.overwrite,
                                             base_model=args.base_model, log=lambda line: print(line, file=sys.stderr))
        else:
            out = convert.checkpoint_to_hf(args.checkpoint, args.to_hf, overwrite=args.overwrite,
                                           merge_lora=args.merge_lora, dtype=convert.EXPORT_DTYPES[args.dtype])
    else:
        if not args.to_checkpoint:
            parser.error("--hf-dir needs --to-checkpoint OUT_DIR")
        out = convert.hf_to_checkpoint(args.hf_dir, args.to_checkpoint, overwrite=args.overwrite)
    print(f"wrote {out}")
    return 0


def graph_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="titan-tpu graph",
        description="Capture the training step as one graph (as --training.mode graph does) and dump it "
                    "without training: a summary on stdout and the readable graph in a text file. "
                    "Config overrides as for train.")
    parser.add_argument("--config", help="TOML recipe, e.g. configs/llama3_debug.toml")
    parser.add_argument("--out", help="where to write the graph (default: <output_dir>/graph/train_step.txt)")
    args, overrides = parser.parse_known_args(argv)

    from titan_tpu.components.build import Components
    from titan_tpu.config import build_config
    from titan_tpu.kinds import kind_of
    from titan_tpu.run.setup import prepare_run

    # The trainer captures the step exactly as graph mode does; the "eager" backend compiles nothing.
    cfg = build_config(args.config, overrides + ["--training.mode", "graph", "--compile.backend", "eager"])
    with _process_group_cleanup():
        parts = Components(prepare_run(cfg), kind_of(cfg))
        step = parts.step_fn
        if parts.is_main:
            out = Path(args.out) if args.out else parts.run_dir / "graph" / "train_step.txt"
            out.parent.mkdir(parents=True, exist_ok=True)
            # With accumulation: the micro-batch program, then the update program.
            programs = [c for c in (step.captured, step.captured_update) if c is not None]
            out.write_text("\n".join(c.graph_module.print_readable(print_output=False) for c in programs))
            tokens = parts.run.step_tokens  # the kind's rows per sample (a DPO pair is two rows), every rank's
            print(step.summary())
            print(f"  estimated model FLOPs per step: {parts.flops_per_token * tokens / 1e9:.1f} GFLOP "
                  f"({tokens:,} tokens x {parts.flops_per_token / 1e6:.1f} MFLOP/token)")
            print(f"graph written to {out}")
    return 0


def kernels_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="titan-tpu kernels",
        description="List, per op, the kernel implementations, whether each runs on this machine, and "
                    "which one --kernels.<op> auto picks (set one with e.g. --kernels.attention sdpa).")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "tpu"],
                        help="device type to describe (auto: the one training would use here)")
    args = parser.parse_args(argv)

    from titan_tpu.device import get_backend
    from titan_tpu.kernels import describe

    device_type = get_backend(args.device).device.type if args.device == "auto" else args.device
    print(f"kernels for device {device_type}:")
    print(describe(device_type))
    return 0


def plan_main(argv: list[str]) -> int:
    from titan_tpu.tools.plan_cmd import main as plan

    return plan(argv)


def prepare_data_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="titan-tpu prepare-data",
        description="Tokenize a config's data sources (and data.val_source) into the token shards training reads, "
                    "in parallel processes, resumable after an interruption (docs/data.md). Config overrides as "
                    "for train.")
    parser.add_argument("--config", help="TOML recipe, e.g. configs/llama3_debug.toml")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                        help="tokenizer processes (default: one per CPU); 1 tokenizes in this process")
    args, overrides = parser.parse_known_args(argv)
    if args.workers < 1:
        raise ValueError(f"--workers {args.workers} must be >= 1")

    from titan_tpu.config import build_config
    from titan_tpu.data.build import prepare_data
    from titan_tpu.files import default_cache_dir
    from titan_tpu.run.setup import prepare_run

    setup = prepare_run(build_config(args.config, overrides))
    cfg = setup.cfg
    prepared = prepare_data(cfg.data, setup.sources, vocab_size=setup.spec.args.vocab_size,
                            tokenizer_path=setup.tokenizer_path, cache_dir=cfg.data.cache_dir or default_cache_dir(),
                            workers=args.workers)
    print(f"prepared {len(prepared.train) + len(prepared.val)} source(s) with {prepared.tokenizer}")
    return 0


def report_main(argv: list[str]) -> int:
    from titan_tpu.tools.report import main as report

    return report(argv)


def hf_sweep_main(argv: list[str]) -> int:
    from titan_tpu.tools.hf_sweep import main as sweep

    return sweep(argv)


def compile_main(argv: list[str]) -> int:
    from titan_tpu.tools.compile_cmd import compile_main as compile_for_tpu

    return compile_for_tpu(argv)


def verify_main(argv: list[str]) -> int:
    from titan_tpu.tools.verify import main as verify

    return verify(argv)


def lighthouse_main(argv: list[str]) -> int:
    from titan_tpu.train.replica_ft import main as lighthouse

    lighthouse(argv)  # until killed
    return 0


def launch_main(argv: list[str]) -> int:
    from titan_tpu.tools.launch import main as launch

    return launch(argv)


def config_main(argv: list[str]) -> int:
    from titan_tpu.tools.config_reference import main as reference

    return reference(argv)


COMMANDS = {"train": train_main, "eval": eval_main, "generate": generate_main, "convert": convert_main,
            "graph": graph_main, "kernels": kernels_main, "plan": plan_main, "hf-sweep": hf_sweep_main,
            "prepare-data": prepare_data_main, "report": report_main, "verify": verify_main, "config": config_main,
            "compile": compile_main, "lighthouse": lighthouse_main, "launch": launch_main}

# One line per command for `titan-tpu --help`, in the order a new user meets them.
SUMMARIES = {
    "train": "train a model from a TOML recipe plus --section.key overrides (also under torchrun)",
    "config": "list every config key with its type, default and meaning",
    "plan": "predict memory, FLOPs, communication and speed before touching hardware; --search for the best knobs",
    "verify": "check a model (native or a Hugging Face directory) end to end before a long run",
    "prepare-data": "tokenize a recipe's data sources once, into the shared token cache",
    "eval": "loss and perplexity of a checkpoint or an HF directory on held-out text; --tasks: lm-eval benchmarks",
    "generate": "continue prompts with a checkpoint or an HF directory: greedy or sampled, streamed",
    "convert": "checkpoint <-> Hugging Face directory",
    "report": "plots of one or more runs in one HTML file",
    "launch": "start a run on every host of a slice: run it on each host; hosts and chips are derived",
    "lighthouse": "the meeting point of replica groups that survive each other's faults (fault_tolerance)",
    "graph": "write the captured training step (graph mode) as text",
    "compile": "XLA's TPU compiler's per-chip memory and FLOPs for the captured step, on a CPU (needs .venv-tpu)",
    "kernels": "kernel implementations per op, which run here, and what auto picks",
    "hf-sweep": "train every Hugging Face causal-LM type tiny and compare with transformers",
}
DOCS = "docs/README.md (the user guide, one page per topic)"


def usage() -> str:
    """What `titan-tpu` and `titan-tpu --help` print."""
    width = max(map(len, COMMANDS))
    lines = ["usage: titan-tpu COMMAND [options]   (titan-tpu COMMAND --help for a command's options)", "",
             "commands:"]
    lines += [f"  {name:<{width}}  {SUMMARIES[name]}" for name in SUMMARIES]
    lines += ["", "options:", f"  {'--version':<{width}}  the titan-tpu and torch versions", "",
              f"guide: {DOCS}"]
    return "\n".join(lines)


def version() -> str:
    from importlib.metadata import PackageNotFoundError, version as package_version

    import torch

    try:
        ours = package_version("titan-tpu")
    except PackageNotFoundError:  # run from a source tree that was not installed
        ours = "(not installed)"
    return f"titan-tpu {ours} (torch {torch.__version__}, Python {sys.version.split()[0]})"


# `titan-tpu compile` compiles for a TPU slice with libtpu's compile-only client, on any machine: it
# needs no TPU and must not look for one. Set before torch is first imported (the console script
# imports nothing heavy before `main`): torch would otherwise load torch-tpu through its backend
# auto-loading, and libtpu would ask the cloud metadata server which TPU this is (minutes of
# retries on a machine that is not a TPU VM); a compile-only client may also load libtpu beside
# another process's. A value the user set is kept.
COMPILE_ENVIRONMENT = {"TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "TPU_SKIP_MDS_QUERY": "1",
                       "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "compile":
        for name, value in COMPILE_ENVIRONMENT.items():
            os.environ.setdefault(name, value)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    if argv[0] == "--version":
        print(version())
        return 0
    if argv[0] not in COMMANDS:
        print(f"error: unknown command {argv[0]!r}; use one of {', '.join(SUMMARIES)} (titan-tpu --help)",
              file=sys.stderr)
        return 2
    from titan_tpu.errors import RunError

    try:
        return COMMANDS[argv[0]](argv[1:])
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        return _one_line_error(e, code=2)
    except RunError as e:
        return _one_line_error(e, code=1)


def _one_line_error(error: BaseException, *, code: int) -> int:
    """`error: <message>` on stderr, and `code`. Under torchrun also in the error file it names for this
    rank (TORCHELASTIC_ERROR_FILE): torchrun prints that message as the failure's root cause in the
    summary that ends its output, where its own traceback would otherwise bury our line."""
    line = f"error: {error}"
    print(line, file=sys.stderr)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        import time

        record = {"message": {"message": line, "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))}}}
        try:
            Path(error_file).write_text(json.dumps(record))
        except OSError:
            pass  # the line on stderr stands
    return code


def exit_process(code: int) -> None:
    """End a command-line process with `code`. A rank of a distributed run (WORLD_SIZE > 1) leaves
    with os._exit, skipping interpreter finalization: after the process group is destroyed its
    gloo worker threads can still be releasing a finished collective, and CPython kills a thread
    that needs the GIL during finalization inside a noexcept destructor, which aborts the process
    ("terminate called without an active exception"; docs/known-issues.md, 1b). Everything the
    run writes (checkpoints, metrics, TensorBoard) is closed before this point."""
    sys.stdout.flush()
    sys.stderr.flush()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        os._exit(code)
    sys.exit(code)


def run() -> None:
    """The `titan-tpu` console script."""
    exit_process(main())


if __name__ == "__main__":
    run()
