"""Where do ours and transformers part? Max |difference| of every decoder layer's output, fp32.

    python skills/onboard-model/scripts/layer_diff.py HF_DIR [--tokens 512]

For the Transformers backend (models verify runs with "backend hf"): our HFCausalLM loaded as train
loads it, against transformers' own from_pretrained of the same directory, both asked for their
hidden states on the same tokens. The first layer with a non-zero difference holds the cause.
"""

import argparse
import sys

import torch


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("hf_dir")
    parser.add_argument("--tokens", type=int, default=512)
    args = parser.parse_args()

    from titan_tpu.models.hf.hooks import _CALL_CONTEXT
    from titan_tpu.tools import verify_checks
    from titan_tpu.tools.subject import resolve

    subject = resolve(args.hf_dir, work_dir=__import__("pathlib").Path("/tmp/layer_diff"), tiny=False)
    if subject.backend != "hf":
        print("this directory runs on the native backend; compare with tests/test_hf_parity.py instead")
        return 2
    ours, ref = verify_checks.loaded_model(subject), verify_checks.reference_model(subject)
    ours.eval()
    n = min(args.tokens, verify_checks.max_len(subject))
    tokens = verify_checks.corpus_tokens(verify_checks.vocab_size(subject), n)[None]
    token = _CALL_CONTEXT.set((ours.kernels, None))
    with torch.no_grad():
        mine = ours.hf_model(input_ids=tokens, use_cache=False, output_hidden_states=True).hidden_states
        theirs = ref(input_ids=tokens, use_cache=False, output_hidden_states=True).hidden_states
    _CALL_CONTEXT.reset(token)
    for i, (a, b) in enumerate(zip(mine, theirs)):
        print(f"{'embeddings' if i == 0 else f'layer {i - 1}'}: max |difference| {(a - b).abs().max().item():.3e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
