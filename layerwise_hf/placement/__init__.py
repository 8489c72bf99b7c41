"""Where one parameter's step and state live when not plainly on its device: the inner-optimizer wrappers
(`local_shard`: FSDP2's local shard as a plain tensor; `host_step`: on the host) and the runtime of host offload
(`offload`: gradients waiting in host buffers; `transfer`: copies beside compute; `offloading`: turning it on)."""
