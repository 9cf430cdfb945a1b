"""The training engine: the project's GPT, token windows from object storage, and a
torch.distributed data-parallel loop that checkpoints to object storage."""
