"""The optimizer and what it does with each gradient: `LayerwiseOptimizer` (`optimizer`) is the Optimizer's face;
the per-gradient pipeline (`pipeline`) runs the step window (`window`) and the stages (loss scaling `grad_scaler`,
offload `host_offload`, clipping `clipping`); the norm pass (`norm_pass`), the memory meter (`memory`) and the state
dicts by parameter name (`state`)."""
