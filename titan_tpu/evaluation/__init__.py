"""How good a model is: `titan-tpu eval` and the [evaluation] tasks scored during training.

- `loss.py`: `titan-tpu eval`, the loss and perplexity of a checkpoint, an HF directory or a
  recipe's model over a token file or a text corpus; `load_eval_model`, the model as every
  evaluation (and `titan-tpu generate`) loads it.
- `rows.py`: `eval --rows`, the loss over a vision-language model's image-text chat rows.
- `tasks.py`: `eval --tasks`, lm-evaluation-harness benchmarks of the loaded model (`run_tasks`).
- `harness.py`: `HarnessLM`, our model as an lm-eval model class, and `ScoringRanks`, each rank's
  share of the requests.
- `lm_eval_tasks.py`: the tasks lm-eval loads and scores, and their results turned into metrics.
- `during_training.py`: `TaskEvaluation`, the [evaluation] tasks scored on the model being trained.

Below the assembly and the loops (loops/base.py runs `TaskEvaluation`): nothing here imports
components/ or loops/ at run time. lm-eval is the optional eval extra (extras.py `require_lm_eval`).
"""
