"""The one exception type the plugin raises for bad user input."""


class MegatronPluginConfigError(ValueError):
    """A setting has a value we cannot run with.

    The message always names the setting, the value it had and what to do instead, and it is raised
    before any process group is created, so a bad launch fails on every rank instead of hanging.
    """

    def __init__(self, setting: str, value, fix: str):
        self.setting, self.value, self.fix = setting, value, fix
        super().__init__(f"{setting}={value!r}: {fix}")
