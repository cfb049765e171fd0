"""Package data `edgeinfer.platforms_data`: one TOML file per device profile (read by
`edgeinfer.platforms.load_profiles`). No code lives here."""
