"""Demo tasks on data that ships with installed packages (no downloads)."""
