"""From a client's request to what placement needs: the parsed OpenAI request, the rendered
chat template, token ids and block hashes (``PromptPreparer``)."""
