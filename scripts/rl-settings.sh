# The post-training settings `make demo` and scripts/rl-compare.sh share (sourced, not run):
# SFT on the tiny model to partial accuracy on RL_TASK, then on-policy RL on it. What these
# settings gave is in bench/results/rl_tiny.txt; docs/post-training.md says how to reproduce.
# (mul was tried first: after SFT the tiny model answers no held-out product right, so RL sees
# no reward; sort reaches a few percent after 200 SFT steps.)
RL_TASK=${RL_TASK:-sort}
SFT_STEPS=${SFT_STEPS:-200}
SFT_ARGS=(--task "$RL_TASK" --steps "$SFT_STEPS" --set train.batch_size=32 --set train.lr=3e-3
          --set train.warmup_steps=5 --eval-every 50 --eval-problems 200 --max-new 10)
RL_ARGS=(--task "$RL_TASK" --prompts 16 --group 8 --max-new 10 --eval-every 10 --eval-problems 200
         --set train.batch_size=64 --set train.lr=1e-3 --set train.warmup_steps=0 --set train.min_lr_ratio=1
         --set train.weight_decay=0 --set train.checkpoint_every=0)
