"""Other formats in and out: Hugging Face export and `init_from`, mindformers export, and
`import-config` of a mindformers YAML."""
