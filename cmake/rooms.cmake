# Rooms: each library's headers are reachable only by the targets that link it.
#
#   mlakv_room(<target> <dir>)
#
# <dir> is a folder of the project (e.g. server/core); its headers are then
# included as "<dir>/<file>.h" by <target> and by every target that links
# <target> (PUBLIC), and by nothing else: the project has no global include
# directory, so an include that the CMake graph does not allow fails to
# compile. How: a folder of the build tree, rooms/<target>/, holds the path
# <dir> as a symbolic link to the source folder, and is <target>'s include
# directory; a room therefore exposes exactly its own folder.
function(mlakv_room target dir)
  set(root ${PROJECT_BINARY_DIR}/rooms/${target})
  set(link ${root}/${dir})
  get_filename_component(parent ${link} DIRECTORY)
  file(MAKE_DIRECTORY ${parent})
  if(NOT EXISTS ${link})
    file(CREATE_LINK ${PROJECT_SOURCE_DIR}/${dir} ${link} SYMBOLIC)
  endif()
  target_include_directories(${target} PUBLIC $<BUILD_INTERFACE:${root}>)
endfunction()
