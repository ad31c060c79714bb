"""Drop-in integrations with training frameworks, one module per framework.

Importing `ditron_ep` never imports a framework: import the module of the one you use
(`ditron_ep.integrations.deepspeed`), which imports it then and checks its version.
"""
