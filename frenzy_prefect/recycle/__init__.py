"""ReCycle: keep data x pipeline parallel training running through failures by re-routing micro-batches."""
