"""The bases: which optimizer each trainable tensor gets. `<base>_layerwise` names resolve to a factory that builds
one parameter's optimizer (`registry`), GaLore / APOLLO choose projected tensors from the model (`galore`),
`muon_layerwise` picks Muon or AdamW per tensor (`muon`), and `support` holds every refusal with its one message."""
