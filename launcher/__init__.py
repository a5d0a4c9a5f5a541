"""meshrun's launcher: compose -> validate -> plan -> launch. Never imports torch."""
