"""``colossal benchmark``: every plugin configuration on a GPT workload, one subprocess each."""
