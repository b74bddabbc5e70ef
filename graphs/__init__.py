"""flowrl's algorithm graphs (installed as the package ``flowrl.graphs``). Read them, copy them."""
