//! Templates built through E2B's template API: names, builds and tags as
//! the E2B gateway keeps them. A ready build is a Cairn image plus the
//! [`ImageConfig`] its sandboxes start with. Schema and durability notes:
//! `migrations/sqlite/0017_e2b_templates.sql`.

pub use cairn_state::e2b_templates::*;

use crate::state::ImageConfig;
use crate::{Engine, EngineError};

impl Engine {
    pub fn start_e2b_template_build(
        &self,
        name: &str,
        new_id: &str,
        build_id: &str,
        tags: &[String],
    ) -> Result<E2bTemplate, EngineError> {
        Ok(self
            .db
            .start_e2b_template_build(name, new_id, build_id, tags, crate::now_ms())?)
    }

    pub fn e2b_templates(&self) -> Result<Vec<E2bTemplate>, EngineError> {
        Ok(self.db.e2b_templates()?)
    }

    pub fn e2b_template(&self, key: &str) -> Result<Option<E2bTemplate>, EngineError> {
        Ok(self.db.e2b_template(key)?)
    }

    pub fn e2b_template_build(&self, id: &str) -> Result<Option<TemplateBuild>, EngineError> {
        Ok(self.db.e2b_template_build(id)?)
    }

    pub fn unfinished_e2b_template_builds(&self) -> Result<Vec<TemplateBuild>, EngineError> {
        Ok(self.db.unfinished_e2b_template_builds()?)
    }

    pub fn claim_e2b_template_build(&self, id: &str) -> Result<bool, EngineError> {
        Ok(self.db.claim_e2b_template_build(id)?)
    }

    pub fn finish_e2b_template_build(
        &self,
        build: &TemplateBuild,
        outcome: Result<(&str, &ImageConfig), &BuildFailure>,
        logs: &[BuildLogLine],
    ) -> Result<(), EngineError> {
        Ok(self
            .db
            .finish_e2b_template_build(build, outcome, logs, crate::now_ms())?)
    }

    pub fn e2b_template_tags(&self, template_id: &str) -> Result<Vec<TemplateTag>, EngineError> {
        Ok(self.db.e2b_template_tags(template_id)?)
    }

    pub fn tag_e2b_template_build(
        &self,
        template_id: &str,
        build_id: &str,
        tags: &[String],
    ) -> Result<(), EngineError> {
        Ok(self
            .db
            .tag_e2b_template_build(template_id, build_id, tags, crate::now_ms())?)
    }

    pub fn untag_e2b_template(&self, template_id: &str, tags: &[String]) -> Result<u64, EngineError> {
        Ok(self.db.untag_e2b_template(template_id, tags)?)
    }

    /// Forgets a template and removes the images its builds made (a
    /// sandbox running one keeps its layers).
    pub fn delete_e2b_template(&mut self, template_id: &str) -> Result<(), EngineError> {
        let images = self.db.delete_e2b_template(template_id)?;
        // The template was the caller's to delete: its builds' images go
        // with it, by their stored names, whoever's engine built them.
        self.as_administrator(|e| {
            for image in images {
                match e.remove_image(&image) {
                    Ok(()) => {}
                    Err(EngineError::Image(crate::images::ImageError::NotFound(_))) => {}
                    Err(err) => return Err(err),
                }
            }
            Ok(())
        })
    }
}
