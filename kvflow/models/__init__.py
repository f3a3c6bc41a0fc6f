"""Model families: one file each (its config fields, weight names, module and what it
supports), found through registry.py."""
