"""The plan's choices that the command line lists before anything heavy is imported."""

CLIP_MODES = ("exact", "previous", "per_param", "off")  # LayerwiseTrainingArguments.layerwise_clip
DEVICES = ("cuda", "cpu")  # whose torch optimizer defaults the step uses
OFFLOAD_MODES = ("none", "gradients", "optimizer")  # LayerwiseTrainingArguments.layerwise_offload
