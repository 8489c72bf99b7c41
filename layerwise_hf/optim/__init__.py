"""The optimizer and what it does with each gradient: `LayerwiseOptimizer` (`optimizer`) wires the step window
(`window`), the gate that clips, steps and frees (`gate`, `clipping`, `grad_scaler`), the norm pass (`norm_pass`), the
memory meter (`memory`) and the state dicts by parameter name (`state`)."""
