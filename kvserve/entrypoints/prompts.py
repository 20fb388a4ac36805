"""The built-in chat prompts of ``kvserve generate`` (the main job): varied tasks and lengths."""

BUILTIN_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the ocean at night.",
    "Explain in two sentences why the sky is blue.",
    "Give me three tips for writing clean Python code.",
    "What is 17 multiplied by 23? Show your steps.",
    "Translate 'Good morning, how are you?' into Spanish and French.",
    "Summarize the plot of Romeo and Juliet in one paragraph.",
    "What is the difference between a list and a tuple in Python?",
    "Suggest a name for a coffee shop run by cats.",
    "Write a short, polite email declining a meeting invitation.",
    "List the planets of the solar system in order from the Sun.",
    "Why do we need sleep? Answer briefly.",
    "Write a Python function that checks whether a string is a palindrome.",
    "What are the main causes of climate change?",
    "Describe the taste of a lemon to someone who has never had one.",
    "Give me a simple recipe for pancakes.",
    "What does an operating system do?",
    "Tell me a fun fact about octopuses.",
]
