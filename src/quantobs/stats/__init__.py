"""Statistics: what observers keep of the batches they see."""
