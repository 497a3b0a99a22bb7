"""A study config small enough for tests (seconds per run)."""

from selfattn.study.training import StudyConfig

TINY = StudyConfig(
    steps=50,
    batch_size=8,
    warmup=5,
    check_every=5,
    ema_decay=0.9,
    train_len=4,
    eval_factor=2,
    eval_samples=4,
    num_hiddens=16,
    num_heads=2,
    num_layers=1,
    ffn_hiddens=32,
)
