"""Images in: the decoded, bounded inputs (inputs.py), reading them from the network (media.py)
and turning them into a model's placeholder tokens and pixel values (processor.py)."""
