# SCons build script of tinydeploy's offline Cortex-M PlatformIO platform.
#
# PlatformIO runs this for `pio run`. Projects bring their own startup code (vector table, reset
# handler) and linker script (`board_build.ldscript` in platformio.ini), so the program is linked
# with -nostartfiles (and newlib-nano, like the generated Makefile). CPU and FPU flags come from
# the board manifest (build.cpu, build.fpu, build.float_abi), which tinydeploy generates from
# boards/<id>.json.
import os

from platformio.device.list.util import list_serial_ports
from SCons.Script import (ARGUMENTS, AlwaysBuild, Builder, Default,  # pylint: disable=import-error
                          DefaultEnvironment)

env = DefaultEnvironment()
board = env.BoardConfig()

cpu_flags = ["-mcpu=%s" % board.get("build.cpu"), "-mthumb"]
if board.get("build.fpu", ""):
    cpu_flags += ["-mfloat-abi=%s" % board.get("build.float_abi", "hard"),
                  "-mfpu=%s" % board.get("build.fpu")]
else:
    cpu_flags += ["-mfloat-abi=soft"]

env.Replace(
    AR="arm-none-eabi-ar",
    AS="arm-none-eabi-as",
    CC="arm-none-eabi-gcc",
    CXX="arm-none-eabi-g++",
    GDB="arm-none-eabi-gdb",
    OBJCOPY="arm-none-eabi-objcopy",
    RANLIB="arm-none-eabi-ranlib",
    SIZETOOL="arm-none-eabi-size",
    ARFLAGS=["rc"],
    PROGNAME="firmware",
    PROGSUFFIX=".elf",
    SIZEPROGREGEXP=r"^(?:\.isr_vector|\.vectors|\.text|\.rodata|\.data|\.ARM\.exidx|\.ARM\.extab)\s+(\d+).*",
    SIZEDATAREGEXP=r"^(?:\.data|\.bss|\.noinit|\.stack|\.heap)\s+(\d+).*",
    SIZECHECKCMD="$SIZETOOL -A -d $SOURCES",
    SIZEPRINTCMD="$SIZETOOL -B -d $SOURCES",
)

env.Append(
    ASFLAGS=cpu_flags,
    ASPPFLAGS=["-x", "assembler-with-cpp"],
    CCFLAGS=cpu_flags + ["-ffunction-sections", "-fdata-sections", "-Wall"],
    LINKFLAGS=cpu_flags + ["-nostartfiles", "--specs=nano.specs", "-Wl,--gc-sections",
                           "-Wl,-Map,%s" % os.path.join("$BUILD_DIR", "firmware.map")],
    LIBS=["m"],
    BUILDERS=dict(
        ElfToBin=Builder(action=env.VerboseAction("$OBJCOPY -O binary $SOURCES $TARGET", "Making $TARGET"),
                         suffix=".bin"),
        ElfToHex=Builder(action=env.VerboseAction("$OBJCOPY -O ihex $SOURCES $TARGET", "Making $TARGET"),
                         suffix=".hex"),
    ),
)

# The project's linker script, relative to the project folder.
ldscript = env.get("LDSCRIPT_PATH")
if not ldscript:
    print("Error: no linker script; set board_build.ldscript in platformio.ini")
    env.Exit(1)
if not os.path.isabs(env.subst(ldscript)):
    env.Replace(LDSCRIPT_PATH=os.path.join(env.subst("$PROJECT_DIR"), env.subst(ldscript)))

elf = env.BuildProgram()
env.Depends(elf, env.subst("$LDSCRIPT_PATH"))
firmware_bin = env.ElfToBin(os.path.join("$BUILD_DIR", "${PROGNAME}"), elf)
firmware_hex = env.ElfToHex(os.path.join("$BUILD_DIR", "${PROGNAME}"), elf)

target_size = env.Alias("size", elf, env.VerboseAction("$SIZEPRINTCMD", "Calculating size $SOURCE"))
AlwaysBuild(target_size)


# Upload: a real board through bossac (SAM-BA bootloaders such as the Arduino Nano 33 BLE's, entered
# by opening the port at 1200 baud), OpenOCD (ST-LINK probes), or any command given as
# upload_command in platformio.ini.
def before_upload(target, source, env):  # pylint: disable=unused-argument
    env.AutodetectUploadPort()
    if board.get("upload.use_1200bps_touch", False):
        before_ports = list_serial_ports()
        env.TouchSerialPort("$UPLOAD_PORT", 1200)
        if board.get("upload.wait_for_upload_port", False):
            env.Replace(UPLOAD_PORT=env.WaitForNewSerialPort(before_ports))


protocol = env.subst("$UPLOAD_PROTOCOL") or board.get("upload.protocol", "")
if env.GetProjectOption("upload_command", ""):
    env.Replace(UPLOADCMD=env.GetProjectOption("upload_command"))
    upload_actions = [env.VerboseAction("$UPLOADCMD", "Uploading $SOURCE")]
elif protocol == "sam-ba":
    env.Replace(UPLOADER="bossac",
                UPLOADERFLAGS=["--port", '"$UPLOAD_PORT"', "-U", "-i", "-e", "-w", "-R"],
                UPLOADCMD="$UPLOADER $UPLOADERFLAGS $SOURCES")
    if int(ARGUMENTS.get("PIOVERBOSE", 0)):
        env.Prepend(UPLOADERFLAGS=["--debug"])
    upload_actions = [env.VerboseAction(before_upload, "Looking for upload port..."),
                      env.VerboseAction("$UPLOADCMD", "Uploading $SOURCE")]
elif protocol == "stlink":
    # ST-LINK probes (NUCLEO, Discovery boards) through OpenOCD and its board file
    env.Replace(UPLOADER="openocd",
                UPLOADCMD='$UPLOADER -f "%s" -c "program %s verify reset exit"'
                % (board.get("upload.openocd_config", "interface/stlink.cfg"),
                   os.path.join("$BUILD_DIR", "${PROGNAME}.elf")))
    upload_actions = [env.VerboseAction("$UPLOADCMD", "Uploading $SOURCE")]
else:
    def no_upload(target, source, env):  # pylint: disable=unused-argument
        print("Error: board %s has no upload protocol; set upload_command in platformio.ini"
              % env.subst("$BOARD"))
        env.Exit(1)
    upload_actions = [env.VerboseAction(no_upload, "Uploading $SOURCE")]

AlwaysBuild(env.Alias("upload", firmware_bin, upload_actions))

# PlatformIO's own main script replaces "size" by its "checkprogsize" (RAM/Flash use against the board).
Default([env.Alias("buildprog", [firmware_bin, firmware_hex]), target_size])
