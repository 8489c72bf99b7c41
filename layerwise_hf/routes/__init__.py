"""The routes: how a (reduced) gradient reaches the pipeline, `sink.grad_ready(i)`. Local hooks and FSDP2 hooks
(`hooks`), the data-parallel reducer that replaces DDP (`data_parallel`), a DDP comm hook (`ddp`), FSDP2 local shards
for optimizers that cannot step a DTensor (`local_shard`), and which of them a prepared model gets (`distributed`)."""
