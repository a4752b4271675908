"""lm-eval log-likelihood requests answered two ways on one JAX-path checkpoint, printed as JSON: by
the JAX path's scoring program (graph/jax_step.py `JaxStep.score`, the scorer [evaluation] uses
during training) and by the harness over the eager model on the host copy of the same weights,
which is what `titan-tpu eval --tasks` scores with. test_jax_path.py compares them request by
request: greedy flags equal, log-probabilities close.

    python tests/tpu/jax_scoring.py CHECKPOINT -- TRAIN_OVERRIDES...   (one process, the JAX path)

The requests are harness_fixtures' parity ones plus, so that some greedy flags are True, requests
whose continuation is the checkpoint's own greedy next token (harness_fixtures.greedy_pairs, from
the eager side, computed before either side scores).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: harness_fixtures

from harness_fixtures import GREEDY_CONTEXTS, greedy_pairs, instances, loglikelihood_requests  # noqa: E402

from titan_tpu.config import build_config  # noqa: E402
from titan_tpu.evaluation.during_training import _positions  # noqa: E402
from titan_tpu.evaluation.harness import HarnessLM  # noqa: E402
from titan_tpu.loops import assemble  # noqa: E402


def main(argv: list[str]) -> None:
    checkpoint, overrides = Path(argv[0]), argv[2:] if argv[1:2] == ["--"] else argv[1:]
    loop = assemble(build_config("configs/llama3_debug.toml", overrides))
    loop.load_checkpoint(checkpoint)  # also the JAX step's device state (Components.load_checkpoint)
    parts = loop.components
    length = _positions(parts.model, parts.spec.args.max_seq_len)
    eager = HarnessLM(parts.model, parts.tokenizer, max_length=length, batch_size=3)
    scored = HarnessLM(parts.model, parts.tokenizer, max_length=length, batch_size=3, scorer=parts.step_fn.score)
    pairs = loglikelihood_requests()[0] + greedy_pairs(eager, GREEDY_CONTEXTS)
    answers = {"pairs": pairs, "eager": eager.loglikelihood(instances("loglikelihood", pairs)),
               "jax": scored.loglikelihood(instances("loglikelihood", pairs))}
    print("ANSWERS " + json.dumps(answers))


if __name__ == "__main__":
    main(sys.argv[1:])
