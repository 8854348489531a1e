"""Command-line overrides shared by the tests that really train."""

# Seconds-long joint recall: tables of up to 2 x 2 (37 positions), 16 validation examples.
TINY_JOINT_RECALL = [
    "data.batch_size=8",
    "data.joint_recall.max_n_context=2",
    "data.joint_recall.max_n_key=2",
    "data.joint_recall.n_context=(1,2)",
    "data.joint_recall.n_key=(1,2)",
    "data.joint_recall.valid_size=16",
    "model.sparse.max_len=38",
]
