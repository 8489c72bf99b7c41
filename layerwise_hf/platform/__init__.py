"""What the libraries and the device give us, and how it differs between versions: the supported version range
(`versions`), every version difference (`compat`), and how a step meets CUDA streams inside backward (`streams`)."""
