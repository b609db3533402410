"""GSM8K few-shot chain-of-thought evaluation over the OpenAI completions API."""
