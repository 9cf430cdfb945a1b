"""The training engine: the project's decoder (GPT-2 and Llama families), token windows from object storage, and a
torch.distributed data-parallel loop that checkpoints to object storage."""
