# The post-training settings `make demo`, scripts/rl-pipeline.sh and scripts/rl-compare.sh share
# (sourced, not run): SFT on the tiny model to partial accuracy on RL_TASK, then on-policy RL on
# it. What these settings gave is in bench/results/rl_tiny.txt; docs/post-training.md says how to
# reproduce it and why these values.
# - sort:len=3-5: after 200 SFT steps the tiny model sorts ~37% of held-out 3..5-digit strings
#   greedily (sort with 3..8 digits reached 7%, mul and add:digits=2 0-3%: too little reward).
# - RL: lr 1e-4 with a 10-step warmup (fresh Adam moments: 2e-4 without warmup lost 15 points in
#   10 steps), temperature 1 (the policy itself), the load-balance term off (--aux-loss-coef 0,
#   the default).
# Every value can be replaced from the environment (scripts/rl-pipeline.sh's gpu-small run does);
# SFT_SET / RL_SET add space-separated section.key=value overrides after these (the last one wins).
RL_TASK=${RL_TASK:-sort:len=3-5}
SFT_STEPS=${SFT_STEPS:-200}
# (the callers add --steps "$SFT_STEPS" and --steps for RL)
SFT_ARGS=(--task "$RL_TASK" --set train.batch_size=32 --set train.lr=3e-3
          --set train.warmup_steps=5 --eval-every "${SFT_EVAL_EVERY:-50}" --eval-problems 200
          --max-new "${SFT_MAX_NEW:-8}")
RL_ARGS=(--task "$RL_TASK" --prompts "${RL_PROMPTS:-16}" --group "${RL_GROUP:-8}" --max-new "${RL_MAX_NEW:-7}"
         --sample-rounds "${RL_ROUNDS:-1}" --eval-every 10 --eval-problems 200
         --aux-loss-coef 0 --set train.batch_size=64 --set train.lr=1e-4 --set train.warmup_steps=10
         --set train.min_lr_ratio=1 --set train.weight_decay=0 --set train.checkpoint_every=0)
for kv in ${SFT_SET:-}; do SFT_ARGS+=(--set "$kv"); done
for kv in ${RL_SET:-}; do RL_ARGS+=(--set "$kv"); done
